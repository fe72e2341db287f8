//! `commitfs mkfs IMAGE --size SIZE [--fast-commit] [--block-size N] [--force]`: size
//! the image file and run `mkfs.ext4` with the options commitfs recommends.

use std::fs::OpenOptions;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};
use commitfs_device::{Access, BlockDevice, DeviceError, FileDevice, IoCategory};
use commitfs_format::superblock::{self as sbf, Superblock};

/// What to make.
#[derive(Debug, Clone, Default)]
pub struct MkfsOptions {
    /// Image size in bytes (required for a regular file, ignored for a block device).
    pub size: Option<u64>,
    pub fast_commit: bool,
    pub block_size: Option<u32>,
    pub label: Option<String>,
    /// Overwrite an existing file system (and shrink its file if asked to).
    pub force: bool,
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

/// Create/size the image and format it. Nothing is changed before every check
/// passed: the image is not in use (the same check `mount` makes, and for an image
/// file the lock stays held until mkfs.ext4 is done, so no mount can start in
/// between), and it holds no file system that would be destroyed (or shrunk)
/// unless `force`.
pub fn make(path: &Path, o: &MkfsOptions) -> Result<()> {
    if let Some(b) = o.block_size {
        if !(b.is_power_of_two() && (1024..=65536).contains(&b)) {
            bail!("block size {b} invalid: use 1024, 2048 or 4096");
        }
    }
    let is_blockdev = std::fs::metadata(path)
        .map(|m| m.file_type().is_block_device())
        .unwrap_or(false);
    // Held (image files) until mkfs.ext4 has finished.
    let mut held = None;
    let size = if is_blockdev {
        // mkfs.ext4 opens the device exclusively itself: check, do not hold.
        let users = FileDevice::users(path)?;
        if !users.is_empty() {
            return Err(DeviceError::InUse {
                path: path.to_owned(),
                users,
            })
            .context("will not make a file system here");
        }
        None
    } else {
        let size = o
            .size
            .context("--size is required for an image file (e.g. --size 1G)")?;
        if size < 1 << 20 {
            bail!("size {size} is too small: ext4 needs at least 1 MiB");
        }
        // create_new: an existing file is never touched before the checks.
        match OpenOptions::new().write(true).create_new(true).open(path) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(e).with_context(|| format!("creating {}", path.display()));
            }
        }
        held = Some(FileDevice::open(path, false).context("will not make a file system here")?);
        Some(size)
    };
    let found = match &held {
        Some(d) => existing_fs(d, path),
        None => existing_fs(&FileDevice::open_with(path, Access::Shared)?, path),
    };
    if let Some(found) = found {
        let cur = held.as_ref().map_or(0, |d| d.size());
        let shrink = match size {
            Some(s) if s < cur => format!(
                " (and shrink the file from {} to {})",
                super::size::human(cur),
                super::size::human(s)
            ),
            _ => String::new(),
        };
        if !o.force {
            bail!(
                "{} already holds {found}; mkfs would destroy it{shrink}. \
                 Use --force to overwrite it",
                path.display()
            );
        }
    }
    if let (Some(d), Some(size)) = (held.as_mut(), size) {
        d.set_file_len(size)
            .with_context(|| format!("sizing {} to {size} bytes", path.display()))?;
    }
    let args = mkfs_args(o);
    let out = Command::new("mkfs.ext4")
        .args(&args)
        .arg(path)
        .output()
        .context("running mkfs.ext4 (install e2fsprogs)")?;
    drop(held);
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

/// A description of the file system on `dev`, if any: ext2/3/4 from its
/// superblock (label, size, last mount), anything else `blkid -p` recognises.
fn existing_fs(dev: &FileDevice, path: &Path) -> Option<String> {
    let mut raw = [0u8; sbf::SUPERBLOCK_SIZE];
    if dev
        .read_at(sbf::SUPERBLOCK_OFFSET, &mut raw, IoCategory::Metadata)
        .is_ok()
        && u16::from_le_bytes([raw[0x38], raw[0x39]]) == 0xEF53
    {
        return Some(describe_ext(&raw));
    }
    // Other file systems (and partition tables): util-linux's low-level probe.
    let out = Command::new("blkid")
        .args(["-p", "-o", "export"])
        .arg(path)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let get = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
            .map(str::to_string)
    };
    let kind = get("TYPE").or_else(|| get("PTTYPE").map(|t| format!("a {t} partition table")))?;
    Some(match get("LABEL") {
        Some(l) => format!("a {kind} file system (label {l:?})"),
        None if kind.contains("partition table") => kind,
        None => format!("a {kind} file system"),
    })
}

/// "an ext4 file system (label "x", 64.0 MiB, last mounted at /mnt on 2026-01-02
/// 03:04:05 UTC)" from a raw superblock (trusted only for what it says).
fn describe_ext(raw: &[u8; sbf::SUPERBLOCK_SIZE]) -> String {
    let sb = Superblock::from_raw_unchecked(raw);
    let kind = if sb.has_incompat(sbf::INCOMPAT_EXTENTS) || sb.has_incompat(sbf::INCOMPAT_64BIT) {
        "ext4"
    } else if sb.has_compat(sbf::COMPAT_HAS_JOURNAL) {
        "ext3"
    } else {
        "ext2"
    };
    let mut facts = Vec::new();
    let label = sb.volume_name();
    if !label.is_empty() {
        facts.push(format!("label {label:?}"));
    }
    if sb.log_block_size() <= 6 {
        if let Some(bytes) = sb.blocks_count().checked_mul(sb.block_size() as u64) {
            facts.push(super::size::human(bytes));
        }
    }
    let dir_raw = &raw[0x88..0x88 + 64];
    let dir =
        String::from_utf8_lossy(&dir_raw[..dir_raw.iter().position(|&b| b == 0).unwrap_or(64)])
            .into_owned();
    let when = sb.mtime();
    match (dir.is_empty(), when) {
        (true, 0) => facts.push("never mounted".into()),
        (false, 0) => facts.push(format!("last mounted at {dir}")),
        (true, t) => facts.push(format!("last mounted {}", utc(t))),
        (false, t) => facts.push(format!("last mounted at {dir} on {}", utc(t))),
    }
    format!("an {kind} file system ({})", facts.join(", "))
}

/// `YYYY-MM-DD HH:MM:SS UTC` (days-to-civil from Howard Hinnant's date
/// algorithms; no date crate for one timestamp).
fn utc(secs: u32) -> String {
    let secs = secs as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_764_075_845), "2025-11-25 13:04:05 UTC");
        assert_eq!(utc(u32::MAX), "2106-02-07 06:28:15 UTC");
    }
}
