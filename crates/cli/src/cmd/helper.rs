//! Mount conventions: `mount -t fuse.commitfs`, `/etc/fstab`, `umount`.
//!
//! mount(8) runs `/sbin/mount.fuse.commitfs SOURCE DIR [-sfnvrw] [-o OPTS]` when it
//! exists. umount(8) (libmount 2.38) looks its helper up by the kernel's type name,
//! `fuse`, never by the subtype: `/sbin/umount.fuse DIR [-dflnrv]`, for every FUSE
//! mount. `commitfs install-helper` makes these symlinks to this program, which
//! dispatches on its name: as `umount.fuse` it unmounts a `fuse.commitfs` mount and
//! waits like `commitfs umount`, and hands any other FUSE mount to `umount -i` (what
//! umount would have done without a helper). Without the links, mount.fuse3
//! (`-t fuse.commitfs` falls back to it) runs `commitfs SOURCE DIR -o OPTS`, which is
//! accepted too.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The helper names mount(8) and umount(8) look for (type `fuse.commitfs`).
pub const MOUNT_HELPER: &str = "mount.fuse.commitfs";
pub const UMOUNT_HELPER: &str = "umount.fuse.commitfs";
/// The name libmount actually runs for FUSE unmounts.
pub const UMOUNT_FUSE_HELPER: &str = "umount.fuse";
/// Where libmount looks for helpers (its fixed search path starts here).
pub const HELPER_DIR: &str = "/sbin";

fn base_name(a: &OsStr) -> &OsStr {
    Path::new(a).file_name().unwrap_or(a)
}

/// Turn the helper calling conventions into ordinary `commitfs` arguments;
/// other command lines come back unchanged. `subcommands` are the names that
/// are not a mount source in `commitfs SOURCE DIR`.
pub fn rewrite_args(args: Vec<OsString>, subcommands: &[&str]) -> Result<Vec<OsString>> {
    let Some(argv0) = args.first().cloned() else {
        return Ok(args);
    };
    let name = base_name(&argv0);
    if name == MOUNT_HELPER || name == "mount.commitfs" {
        return mount_helper_args(argv0, &args[1..]);
    }
    if name == UMOUNT_HELPER || name == UMOUNT_FUSE_HELPER || name == "umount.commitfs" {
        return umount_helper_args(argv0, &args[1..]);
    }
    // mount.fuse3: `commitfs SOURCE DIR -o OPTS`.
    if args.len() >= 3 {
        let first = args[1].to_string_lossy();
        let second = args[2].to_string_lossy();
        if !first.starts_with('-')
            && !second.starts_with('-')
            && !subcommands.contains(&&*first)
            && first != "help"
        {
            let mut v = vec![argv0, "mount".into()];
            v.extend(args[1..].iter().cloned());
            return Ok(v);
        }
    }
    Ok(args)
}

/// `mount.fuse.commitfs SOURCE DIR [-sfnvrw] [-o OPTS] [-t TYPE] [-N NS]`.
fn mount_helper_args(argv0: OsString, rest: &[OsString]) -> Result<Vec<OsString>> {
    let mut pos = Vec::new();
    let mut opts: Vec<OsString> = Vec::new();
    let mut it = rest.iter();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "-o" {
            opts.push(it.next().cloned().context("-o needs a value")?);
        } else if let Some(v) = s.strip_prefix("-o") {
            opts.push(v.into());
        } else if s == "-t" || s == "-N" {
            it.next();
        } else if s.starts_with('-') && s.len() > 1 {
            for c in s[1..].chars() {
                match c {
                    // sloppy, no mtab, verbose, internal-only: nothing to do.
                    's' | 'n' | 'v' | 'i' => {}
                    'r' => opts.push("ro".into()),
                    'w' => opts.push("rw".into()),
                    'f' => bail!("fake mounts (-f) are not supported"),
                    _ => bail!("unknown mount helper flag -{c}"),
                }
            }
        } else {
            pos.push(a.clone());
        }
    }
    if pos.len() != 2 {
        bail!("usage: {MOUNT_HELPER} SOURCE DIR [-o OPTIONS]");
    }
    let mut v = vec![argv0, "mount".into(), pos[0].clone(), pos[1].clone()];
    for o in opts {
        v.push("-o".into());
        v.push(o);
    }
    Ok(v)
}

/// `umount.fuse.commitfs DIR [-dflnrv] [-t TYPE] [-N NS]`.
fn umount_helper_args(argv0: OsString, rest: &[OsString]) -> Result<Vec<OsString>> {
    let mut pos = Vec::new();
    let mut lazy = false;
    let mut flags = String::new();
    let mut it = rest.iter();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "-t" || s == "-N" {
            it.next();
        } else if s.starts_with('-') && s.len() > 1 {
            for c in s[1..].chars() {
                match c {
                    'l' => lazy = true,
                    // detach loop, force, no mtab, remount-ro on failure, verbose:
                    // nothing to do for a commitfs mount; kept for other FUSE mounts.
                    'd' | 'f' | 'n' | 'r' | 'v' => {}
                    _ => bail!("unknown umount helper flag -{c}"),
                }
                flags.push(c);
            }
        } else {
            pos.push(a.clone());
        }
    }
    if pos.len() != 1 {
        bail!("usage: {UMOUNT_FUSE_HELPER} DIR [-dflnrv]");
    }
    let mut v = vec![argv0, "umount".into(), pos[0].clone()];
    if lazy {
        // `umount -l` returns at once: keep that (no waiting for open files).
        v.push("--lazy".into());
        v.push("--no-wait".into());
    }
    // Not ours: `umount -i -FLAGS DIR` (no helper, same flags).
    v.push(format!("--other-fuse=-i{flags}").into());
    Ok(v)
}

/// `commitfs install-helper [--dir DIR] [--remove]`: (un)install the symlinks
/// mount(8) and umount(8) run for type `fuse.commitfs`.
pub fn install(dir: &Path, remove: bool) -> Result<Vec<PathBuf>> {
    let exe = std::env::current_exe()
        .and_then(std::fs::canonicalize)
        .context("finding the commitfs executable")?;
    let mut done = Vec::new();
    for name in [MOUNT_HELPER, UMOUNT_HELPER, UMOUNT_FUSE_HELPER] {
        let link = dir.join(name);
        match std::fs::symlink_metadata(&link) {
            Ok(m) if !m.file_type().is_symlink() => bail!(
                "{} exists and is not a symlink: not touching it",
                link.display()
            ),
            Ok(_) => std::fs::remove_file(&link)
                .with_context(|| format!("removing {}", link.display()))?,
            Err(_) => {}
        }
        if !remove {
            std::os::unix::fs::symlink(&exe, &link)
                .with_context(|| format!("creating {}", link.display()))?;
        }
        done.push(link);
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rw(v: &[&str]) -> Result<Vec<String>> {
        rewrite_args(
            v.iter().map(OsString::from).collect(),
            &["mount", "umount", "info"],
        )
        .map(|v| {
            v.into_iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect()
        })
    }

    #[test]
    fn calling_conventions() {
        // mount(8) with a helper link.
        assert_eq!(
            rw(&[
                "/sbin/mount.fuse.commitfs",
                "/i.img",
                "/mnt",
                "-n",
                "-o",
                "rw,noauto"
            ])
            .unwrap(),
            [
                "/sbin/mount.fuse.commitfs",
                "mount",
                "/i.img",
                "/mnt",
                "-o",
                "rw,noauto"
            ]
        );
        assert_eq!(
            rw(&["mount.commitfs", "/i.img", "/mnt", "-rv"]).unwrap(),
            ["mount.commitfs", "mount", "/i.img", "/mnt", "-o", "ro"]
        );
        assert!(rw(&["mount.fuse.commitfs", "/i.img", "/mnt", "-f"]).is_err());
        assert!(rw(&["mount.fuse.commitfs", "/i.img"]).is_err());
        // umount(8) with a helper link.
        assert_eq!(
            rw(&[
                "/sbin/umount.fuse.commitfs",
                "/mnt",
                "-l",
                "-t",
                "fuse.commitfs"
            ])
            .unwrap(),
            [
                "/sbin/umount.fuse.commitfs",
                "umount",
                "/mnt",
                "--lazy",
                "--no-wait",
                "--other-fuse=-il"
            ]
        );
        assert_eq!(
            rw(&["/sbin/umount.fuse", "/mnt", "-nv"]).unwrap(),
            ["/sbin/umount.fuse", "umount", "/mnt", "--other-fuse=-inv"]
        );
        assert!(rw(&["umount.fuse", "/mnt", "-x"]).is_err());
        // mount.fuse3: `commitfs SOURCE DIR -o OPTS`.
        assert_eq!(
            rw(&["commitfs", "/i.img", "/mnt", "-o", "rw,subtype=commitfs"]).unwrap(),
            [
                "commitfs",
                "mount",
                "/i.img",
                "/mnt",
                "-o",
                "rw,subtype=commitfs"
            ]
        );
        // Ordinary command lines are left alone.
        for v in [
            &["commitfs", "info", "/i.img"][..],
            &["commitfs", "mount", "/i.img", "/mnt"],
            &["commitfs", "--help"],
            &["commitfs", "help", "mount"],
        ] {
            assert_eq!(rw(v).unwrap(), v);
        }
    }
}
