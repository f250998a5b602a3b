//! Which code made a result: the package version and, when built from a git checkout, the commit
//! (recorded by `build.rs`). Every training run writes it into its `summary.json`.

use serde::{Deserialize, Serialize};

/// The version of the code, as recorded in a run's `summary.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodeVersion {
    /// The package version (`Cargo.toml`).
    pub package: String,
    /// The git commit of the build, when it was built from a git checkout.
    pub commit: Option<String>,
}

impl CodeVersion {
    /// The version of the running code.
    pub fn current() -> CodeVersion {
        CodeVersion {
            package: env!("CARGO_PKG_VERSION").to_string(),
            commit: option_env!("ATTNRES_COMMIT").map(str::to_string),
        }
    }
}

impl std::fmt::Display for CodeVersion {
    /// `0.1.0 (commit 1a2b3c4d5e6f)`, or `0.1.0` without a known commit.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.commit {
            Some(c) => write!(f, "{} (commit {})", self.package, &c[..c.len().min(12)]),
            None => write!(f, "{}", self.package),
        }
    }
}
