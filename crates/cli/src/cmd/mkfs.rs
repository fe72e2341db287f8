//! `commitfs mkfs IMAGE --size SIZE [--fast-commit] [--block-size N]`: size the image
//! file and run `mkfs.ext4` with the options commitfs recommends.

use std::fs::OpenOptions;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

/// What to make.
#[derive(Debug, Clone, Default)]
pub struct MkfsOptions {
    /// Image size in bytes (required for a regular file, ignored for a block device).
    pub size: Option<u64>,
    pub fast_commit: bool,
    pub block_size: Option<u32>,
    pub label: Option<String>,
}

/// The `mkfs.ext4` arguments (without the image path).
pub fn mkfs_args(o: &MkfsOptions) -> Vec<String> {
    // -F: also on a regular file; -q: quiet; initialise inode tables and the journal
    // now, so that the image holds no lazily-initialised regions.
    let mut a: Vec<String> = ["-F", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if let Some(b) = o.block_size {
        a.push("-b".into());
        a.push(b.to_string());
    }
    if o.fast_commit {
        a.push("-O".into());
        a.push("fast_commit".into());
    }
    if let Some(l) = &o.label {
        a.push("-L".into());
        a.push(l.clone());
    }
    a
}

/// Create/size the image and format it.
pub fn make(path: &Path, o: &MkfsOptions) -> Result<()> {
    if let Some(b) = o.block_size {
        if !(b.is_power_of_two() && (1024..=65536).contains(&b)) {
            bail!("block size {b} invalid: use 1024, 2048 or 4096");
        }
    }
    let is_blockdev = std::fs::metadata(path)
        .map(|m| m.file_type().is_block_device())
        .unwrap_or(false);
    if !is_blockdev {
        let size = o
            .size
            .context("--size is required for an image file (e.g. --size 1G)")?;
        if size < 1 << 20 {
            bail!("size {size} is too small: ext4 needs at least 1 MiB");
        }
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .with_context(|| format!("creating {}", path.display()))?;
        f.set_len(size)
            .with_context(|| format!("sizing {} to {size} bytes", path.display()))?;
    }
    let args = mkfs_args(o);
    let out = Command::new("mkfs.ext4")
        .args(&args)
        .arg(path)
        .output()
        .context("running mkfs.ext4 (install e2fsprogs)")?;
    if !out.status.success() {
        bail!(
            "mkfs.ext4 {} {} failed ({}): {}{}",
            args.join(" "),
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// `commitfs mkfs`: make the image and say what was made.
pub fn run(path: &Path, o: &MkfsOptions) -> Result<()> {
    make(path, o)?;
    let info = super::info::inspect(path)?;
    println!(
        "Made an ext4 file system on {}: {} blocks of {} bytes ({}), {} inodes, {} groups",
        path.display(),
        info.blocks,
        info.block_size,
        super::size::human(info.blocks * info.block_size as u64),
        info.inodes,
        info.groups
    );
    println!("Features: {}", info.features.join(" "));
    if let Some(j) = &info.journal {
        println!(
            "Journal: inode {}, {} blocks{}",
            j.inode,
            j.s_maxlen,
            if j.fast_commit_blocks > 0 {
                format!(" (including {} fast-commit blocks)", j.fast_commit_blocks)
            } else {
                String::new()
            }
        );
    }
    println!("UUID: {}", info.uuid);
    println!("mkfs.ext4 options: {}", mkfs_args(o).join(" "));
    Ok(())
}
