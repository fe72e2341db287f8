//! Judging an image with `e2fsck -fn` (the project's referee).

use std::path::Path;

/// What `e2fsck -fn` said about an image.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub code: i32,
    pub output: String,
    /// Lines that are neither pass banners nor the summary.
    pub problems: Vec<String>,
}

impl Verdict {
    /// Clean: exit code 0 and nothing reported.
    pub fn is_clean(&self) -> bool {
        self.code == 0 && self.problems.is_empty()
    }
}

/// The closing summary, e.g. `img: 13/16384 files (0.0% non-contiguous), 9579/65536 blocks`.
fn is_summary(l: &str) -> bool {
    l.contains(" files (") && l.contains("non-contiguous), ") && l.ends_with(" blocks")
}

/// Problem lines of e2fsck output: [`commitfs_fs::testutil::problem_lines`] without
/// the summary line.
pub fn problems(output: &str) -> Vec<String> {
    commitfs_fs::testutil::problem_lines(output)
        .into_iter()
        .filter(|l| !is_summary(l))
        .collect()
}

/// Run `e2fsck -fn` on `image` (which must not be mounted read-write).
pub fn check(image: &Path) -> std::io::Result<Verdict> {
    let out = std::process::Command::new("e2fsck")
        .arg("-fn")
        .arg(image)
        .output()?;
    let output = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(Verdict {
        code: out.status.code().unwrap_or(-1),
        problems: problems(&output),
        output,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn judges_output() {
        let clean = "e2fsck 1.47.0 (5-Feb-2023)\nPass 1: Checking inodes, blocks, and sizes\n\
                     Pass 2: Checking directory structure\n\
                     t.img: 13/16384 files (0.0% non-contiguous), 9579/65536 blocks\n";
        assert!(problems(clean).is_empty());
        let bad = format!("{clean}Free blocks count wrong (100, counted=99).\nFix? no\n");
        assert_eq!(problems(&bad).len(), 2);
    }
}
