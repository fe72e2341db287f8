//! Names the commit a binary was built from, for `commitfs --version` (and the
//! bench's results): `COMMITFS_COMMIT` = short hash, `-dirty` when the work tree
//! had changes, or `unknown` outside a git checkout (e.g. a source tarball).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let commit = match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(h) if !h.is_empty() => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{h}-dirty")
            } else {
                h
            }
        }
        _ => "unknown".to_string(),
    };
    println!("cargo:rustc-env=COMMITFS_COMMIT={commit}");
    // Rebuild when HEAD moves: HEAD itself, the branch it points at, packed refs,
    // and the index (a commit or a staged change of the work tree).
    for p in ["HEAD", "index", "packed-refs"] {
        if let Some(path) = git(&["rev-parse", "--git-path", p]) {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
        if let Some(path) = git(&["rev-parse", "--git-path", &r]) {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}
