//! Records the git commit the code is built from, when it is built from a git checkout, so that
//! every run can say which code made it (`attnres::version`). Uncommitted changes are not
//! recorded. A build outside git (a published package) records no commit.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let package = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    let Some(commit) = git(&["rev-parse", "HEAD"]) else {
        println!("cargo:rustc-env=ATTNRES_VERSION={package}");
        return;
    };
    // What `attnres --version` prints.
    println!("cargo:rustc-env=ATTNRES_VERSION={package} (commit {})", &commit[..12]);
    println!("cargo:rustc-env=ATTNRES_COMMIT={commit}");
    // Run again when HEAD moves: HEAD itself, the branch it names, and the packed refs.
    let mut watched = vec!["HEAD".to_string(), "packed-refs".to_string()];
    watched.extend(git(&["symbolic-ref", "-q", "HEAD"]));
    for name in watched {
        if let Some(path) = git(&["rev-parse", "--git-path", &name]) {
            if std::path::Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
}
