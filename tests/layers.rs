//! The library's layers, as `src/lib.rs` states them, hold in the code: a module uses only
//! modules of lower layers (none of its own layer), and no two source files use each other.
//!
//! The check reads the source: `crate::` paths (in `use` and in code), `super::` paths and
//! paths through the child modules a file declares, resolved to the file that defines the
//! module. Test modules (`#[cfg(test)] mod tests` at the end of a file) are left out: a test may
//! use anything.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layer of each top-level module, from `src/lib.rs`'s numbered list (`//! 1. [`base`]: ...`;
/// every module named in backticks and brackets on an item's first line is in that layer).
fn layers(lib: &str) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for line in lib.lines() {
        let Some(item) = line.strip_prefix("//! ") else { continue };
        let Some((number, rest)) = item.split_once(". ") else { continue };
        let Ok(layer) = number.parse::<usize>() else { continue };
        let head = rest.split(':').next().unwrap_or("");
        for part in head.split("[`").skip(1) {
            let name = part.split('`').next().unwrap();
            out.insert(name.to_string(), layer);
        }
    }
    out
}

/// Every `.rs` file under `dir`, with its module path (`src/a/mod.rs` and `src/a.rs`: `a`).
fn modules(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    fn walk(dir: &Path, prefix: &[String], out: &mut BTreeMap<Vec<String>, PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap().to_string();
            if path.is_dir() {
                if prefix.is_empty() && name == "bin" {
                    continue;
                }
                let mut p = prefix.to_vec();
                p.push(name);
                walk(&path, &p, out);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                let mut p = prefix.to_vec();
                if stem != "mod" && stem != "lib" {
                    p.push(stem.to_string());
                }
                out.insert(p, path);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, &[], &mut out);
    out
}

/// The code of a file without its comments and its test module.
fn code(text: &str) -> String {
    let mut out = String::new();
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        if t == "#[cfg(test)]"
            && lines.get(i + 1).is_some_and(|n| n.trim_start().starts_with("mod "))
        {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The paths a piece of code names: `a::b::c` sequences, with `use` groups (`a::{b, c::d}`)
/// expanded.
fn paths(code: &str) -> Vec<Vec<String>> {
    fn ident(c: char) -> bool {
        c.is_alphanumeric() || c == '_'
    }
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    // Reads a path from position i; `prefix` is the group's path so far.
    fn read(
        chars: &[char],
        mut i: usize,
        prefix: Vec<String>,
        out: &mut Vec<Vec<String>>,
    ) -> usize {
        let mut path = prefix;
        loop {
            let start = i;
            while i < chars.len() && ident(chars[i]) {
                i += 1;
            }
            if i == start {
                break;
            }
            path.push(chars[start..i].iter().collect());
            if chars.get(i) == Some(&':') && chars.get(i + 1) == Some(&':') {
                i += 2;
                if chars.get(i) == Some(&'{') {
                    i += 1;
                    loop {
                        while i < chars.len() && chars[i].is_whitespace() {
                            i += 1;
                        }
                        if i >= chars.len() || chars[i] == '}' {
                            return i + 1;
                        }
                        i = read(chars, i, path.clone(), out);
                        while i < chars.len() && chars[i] != ',' && chars[i] != '}' {
                            i += 1;
                        }
                        if chars.get(i) == Some(&',') {
                            i += 1;
                        }
                    }
                }
                continue;
            }
            break;
        }
        out.push(path);
        i
    }
    while i < chars.len() {
        if ident(chars[i]) && (i == 0 || !(ident(chars[i - 1]) || chars[i - 1] == ':')) {
            i = read(&chars, i, Vec::new(), &mut out);
        } else {
            i += 1;
        }
    }
    out.retain(|p| p.len() > 1);
    out
}

/// The child modules a file declares (`mod x;`, `pub mod x;`, `pub(crate) mod x;`).
fn children(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in code.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let Some(k) = words.iter().position(|w| *w == "mod") {
            if let Some(name) = words.get(k + 1).and_then(|w| w.strip_suffix(';')) {
                out.insert(name.to_string());
            }
        }
    }
    out
}

/// The module file a path names (its longest prefix that is a module), if it is another one.
fn target(
    path: &[String],
    here: &[String],
    kids: &BTreeSet<String>,
    mods: &BTreeMap<Vec<String>, PathBuf>,
) -> Option<Vec<String>> {
    let absolute: Vec<String> = match path[0].as_str() {
        "crate" => path[1..].to_vec(),
        "super" => {
            let mut base = here.to_vec();
            let mut rest = path;
            while rest.first().is_some_and(|s| s == "super") {
                base.pop()?;
                rest = &rest[1..];
            }
            base.extend_from_slice(rest);
            base
        }
        "self" => here.iter().chain(&path[1..]).cloned().collect(),
        name if kids.contains(name) => here.iter().chain(path).cloned().collect(),
        _ => return None,
    };
    (0..=absolute.len())
        .rev()
        .map(|n| absolute[..n].to_vec())
        .find(|m| mods.contains_key(m))
        .filter(|m| m.as_slice() != here)
}

#[test]
fn no_module_uses_one_of_its_own_layer_or_above_and_no_two_files_use_each_other() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let layer = layers(&lib);
    let mods = modules(&root.join("src"));
    // Every top-level module is in a layer.
    let tops: BTreeSet<&String> = mods.keys().filter_map(|m| m.first()).collect();
    for top in &tops {
        if top.as_str() != "testutil" {
            assert!(layer.contains_key(*top), "src/lib.rs puts `{top}` in no layer");
        }
    }

    let mut uses: BTreeSet<(Vec<String>, Vec<String>)> = BTreeSet::new();
    let mut wrong = Vec::new();
    for (here, file) in &mods {
        let Some(top) = here.first() else { continue };
        let text = code(&std::fs::read_to_string(file).unwrap());
        let kids = children(&text);
        for p in paths(&text) {
            let Some(there) = target(&p, here, &kids, &mods) else { continue };
            if there.is_empty() {
                continue;
            }
            if let (Some(a), Some(b)) = (layer.get(top), layer.get(&there[0])) {
                if there[0] != *top && b >= a {
                    wrong.push(format!(
                        "{} (layer {a}) uses {} (layer {b}) through `{}`",
                        file.strip_prefix(root).unwrap().display(),
                        there.join("::"),
                        p.join("::")
                    ));
                }
            }
            uses.insert((here.clone(), there));
        }
    }
    for (a, b) in &uses {
        if a < b && uses.contains(&(b.clone(), a.clone())) {
            wrong.push(format!("{} and {} use each other", a.join("::"), b.join("::")));
        }
    }
    wrong.sort();
    wrong.dedup();
    assert!(wrong.is_empty(), "the layers of src/lib.rs do not hold:\n{}", wrong.join("\n"));
}

#[test]
fn the_path_reader_sees_groups_supers_and_children() {
    let text = "use crate::{a::b, c::{d, e::f}};\nmod kid;\nfn g() { super::x::y(); kid::z(); }";
    let ps = paths(text);
    let names: Vec<String> = ps.iter().map(|p| p.join("::")).collect();
    for want in ["crate::a::b", "crate::c::d", "crate::c::e::f", "super::x::y", "kid::z"] {
        assert!(names.contains(&want.to_string()), "{want} not in {names:?}");
    }
    assert_eq!(children(text), BTreeSet::from(["kid".to_string()]));
    let lib = "//! 1. [`base`]: files.\n//! 5. [`train`], [`infer`]: side by side.\n";
    let l = layers(lib);
    assert_eq!((l["base"], l["train"], l["infer"]), (1, 5, 5));
}

#[test]
fn the_readme_layout_names_every_source_folder_and_only_real_paths() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let section = readme.split("## Layout of the code").nth(1).expect("README has its layout");
    let block = section.split("```").nth(1).expect("the layout is a code block");
    let named: BTreeSet<String> = block
        .lines()
        .filter(|l| !l.starts_with(' '))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| w.contains('/') || w.ends_with(".rs"))
        .map(|w| w.trim_end_matches('/').to_string())
        .collect();
    for path in &named {
        assert!(root.join(path).exists(), "README's layout names {path}, which does not exist");
    }
    // Every folder of src/ that holds source files is named.
    let mut folders = BTreeSet::new();
    for file in modules(&root.join("src")).values() {
        let dir = file.parent().unwrap().strip_prefix(root).unwrap();
        if dir != Path::new("src") {
            folders.insert(dir.to_str().unwrap().to_string());
        }
    }
    for dir in std::fs::read_dir(root.join("src/bin")).unwrap() {
        let dir = dir.unwrap().path();
        if dir.is_dir() {
            folders.insert(dir.strip_prefix(root).unwrap().to_str().unwrap().to_string());
        }
    }
    let missing: Vec<&String> = folders.iter().filter(|f| !named.contains(*f)).collect();
    assert!(missing.is_empty(), "README's layout does not name {missing:?}");
}
