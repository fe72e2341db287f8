//! The systems under test: how to check each is installed, make it on the device,
//! mount it, find its journal on disk, unmount and check it.
//!
//! commitfs runs in every journal mode it has; [`commitfs_modes`] is the list to
//! extend when a mode arrives (e.g. a new mkfs feature or mount option).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::measure;
use super::sys::{self, MountGuard};

/// One journal mode of commitfs: how the image is made and mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitfsMode {
    pub id: &'static str,
    pub label: &'static str,
    /// `mkfs.ext4 -O` value.
    pub mkfs_features: &'static str,
    /// `commitfs mount -o` value ("" = none).
    pub mount_opts: &'static str,
    /// Device category that must see writes for the mode to be really active
    /// (the fast-commit area); `None` = always active.
    pub expects_fast_commit: bool,
}

/// commitfs's journal modes. Add a line here when a new one lands.
pub fn commitfs_modes() -> Vec<CommitfsMode> {
    vec![
        CommitfsMode {
            id: "commitfs",
            label: "commitfs (JBD2 ordered)",
            mkfs_features: "^fast_commit",
            mount_opts: "nofast_commit",
            expects_fast_commit: false,
        },
        CommitfsMode {
            id: "commitfs-fc",
            label: "commitfs (fast_commit)",
            mkfs_features: "fast_commit",
            mount_opts: "fast_commit",
            expects_fast_commit: true,
        },
        // Single-flush fast and full commits (docs/FORMAT.md "Fast-commit data
        // checksums"): commitfs's own extension, one flush per fsync instead of
        // a flush and a FUA write. The image carries an incompat bit while
        // mounted; a clean unmount clears it, so e2fsck judges it after the run.
        CommitfsMode {
            id: "commitfs-fc-csum",
            label: "commitfs (fast_commit + fc_data_csum)",
            mkfs_features: "fast_commit",
            mount_opts: "fast_commit,fc_data_csum",
            expects_fast_commit: true,
        },
    ]
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SysKind {
    KernelExt4 { features: &'static str },
    Xfs,
    Fuse2fs,
    Commitfs(CommitfsMode),
}

#[derive(Debug, Clone)]
pub struct System {
    pub id: String,
    pub label: String,
    pub kind: SysKind,
}

/// Every system, in report order.
pub fn all_systems() -> Vec<System> {
    let mut v = vec![
        System {
            id: "ext4".into(),
            label: "kernel ext4 (JBD2)".into(),
            kind: SysKind::KernelExt4 {
                features: "^fast_commit",
            },
        },
        System {
            id: "ext4-fc".into(),
            label: "kernel ext4 (fast_commit)".into(),
            kind: SysKind::KernelExt4 {
                features: "fast_commit",
            },
        },
        System {
            id: "xfs".into(),
            label: "kernel XFS".into(),
            kind: SysKind::Xfs,
        },
        System {
            id: "fuse2fs".into(),
            label: "fuse2fs (e2fsprogs)".into(),
            kind: SysKind::Fuse2fs,
        },
    ];
    for m in commitfs_modes() {
        v.push(System {
            id: m.id.into(),
            label: m.label.into(),
            kind: SysKind::Commitfs(m),
        });
    }
    v
}

/// Byte ranges of the device holding the journal (and its fast-commit tail).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Regions {
    pub journal: Vec<(u64, u64)>,
    pub fast_commit: Vec<(u64, u64)>,
}

impl Regions {
    pub fn in_journal(&self, off: u64) -> bool {
        self.journal.iter().any(|&(a, b)| off >= a && off < b)
    }
    pub fn in_fast_commit(&self, off: u64) -> bool {
        self.fast_commit.iter().any(|&(a, b)| off >= a && off < b)
    }
}

/// A mounted system.
pub struct Mounted {
    pub dir: PathBuf,
    guard: Option<MountGuard>,
    /// The FUSE daemon (commitfs, fuse2fs): its CPU time is measured, and
    /// unmounting waits for it to finish writing.
    pub daemon_pid: Option<u32>,
    /// Kernel journal thread (ext4's jbd2), for CPU time.
    pub kthread_pid: Option<u32>,
}

impl Mounted {
    /// Unmount; for FUSE systems also wait until the daemon has written
    /// everything and exited (the device is quiet afterwards).
    pub fn unmount(mut self) -> Result<()> {
        let r = match self.guard.take() {
            Some(g) => g.unmount(),
            None => Ok(()),
        };
        if let Some(pid) = self.daemon_pid {
            if !sys::wait_pid_gone(pid, Duration::from_secs(120)) {
                bail!("daemon {pid} still running 120 s after unmount");
            }
        }
        r
    }
}

impl System {
    /// Is the system usable here? The error says what is missing.
    pub fn available(&self) -> Result<()> {
        let need = |p: &str, pkg: &str| -> Result<()> {
            if sys::have(p) {
                Ok(())
            } else {
                Err(anyhow!("{p} not found (apt-get install {pkg})"))
            }
        };
        match &self.kind {
            SysKind::KernelExt4 { .. } => {
                need("mkfs.ext4", "e2fsprogs")?;
                kernel_fs("ext4")
            }
            SysKind::Xfs => {
                need("mkfs.xfs", "xfsprogs")?;
                need("xfs_db", "xfsprogs")?;
                kernel_fs("xfs")
            }
            SysKind::Fuse2fs => {
                need("mkfs.ext4", "e2fsprogs")?;
                need("fuse2fs", "fuse2fs")?;
                fuse_ok()
            }
            SysKind::Commitfs(_) => {
                need("mkfs.ext4", "e2fsprogs")?;
                fuse_ok()
            }
        }
    }

    pub fn is_ext4_image(&self) -> bool {
        !matches!(self.kind, SysKind::Xfs)
    }

    pub fn mkfs_desc(&self) -> String {
        match &self.kind {
            SysKind::KernelExt4 { features } => format!("mkfs.ext4 -O {features} {NOLAZY}"),
            SysKind::Xfs => "mkfs.xfs -f".into(),
            SysKind::Fuse2fs => format!("mkfs.ext4 -O ^fast_commit {NOLAZY}"),
            SysKind::Commitfs(m) => format!("mkfs.ext4 -O {} {NOLAZY}", m.mkfs_features),
        }
    }

    pub fn mount_desc(&self) -> String {
        match &self.kind {
            SysKind::KernelExt4 { .. } => "mount -t ext4 (data=ordered, commit=5)".into(),
            SysKind::Xfs => "mount -t xfs".into(),
            SysKind::Fuse2fs => "fuse2fs DEV DIR".into(),
            SysKind::Commitfs(m) => match commitfs_opts(m.mount_opts) {
                o if o.is_empty() => "commitfs mount DEV DIR".into(),
                o => format!("commitfs mount -o {o} DEV DIR"),
            },
        }
    }

    pub fn mkfs(&self, dev: &Path) -> Result<()> {
        let d = dev.to_string_lossy();
        match &self.kind {
            SysKind::KernelExt4 { features } => ext4_mkfs(&d, features),
            SysKind::Fuse2fs => ext4_mkfs(&d, "^fast_commit"),
            SysKind::Commitfs(m) => ext4_mkfs(&d, m.mkfs_features),
            SysKind::Xfs => sys::run("mkfs.xfs", &["-q", "-f", &d]).map(drop),
        }?;
        sys::run("sync", &[])?;
        Ok(())
    }

    /// Where the journal lives on the device just made.
    pub fn regions(&self, dev: &Path) -> Result<Regions> {
        if self.is_ext4_image() {
            ext4_regions(dev)
        } else {
            xfs_regions(dev)
        }
    }

    pub fn mount(&self, dev: &Path, dir: &Path, commitfs_bin: &Path) -> Result<Mounted> {
        std::fs::create_dir_all(dir)?;
        let d = dev.to_string_lossy().to_string();
        let m = dir.to_string_lossy().to_string();
        let devname = dev
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        match &self.kind {
            SysKind::KernelExt4 { .. } | SysKind::Xfs => {
                let t = if matches!(self.kind, SysKind::Xfs) {
                    "xfs"
                } else {
                    "ext4"
                };
                sys::run("mount", &["-t", t, &d, &m])?;
                let guard = MountGuard::adopt(dir);
                let kthread_pid = if t == "ext4" {
                    measure::find_kthread(&format!("jbd2/{devname}-8"))
                } else {
                    None
                };
                Ok(Mounted {
                    dir: dir.to_path_buf(),
                    guard: Some(guard),
                    daemon_pid: None,
                    kthread_pid,
                })
            }
            SysKind::Fuse2fs => {
                sys::run("fuse2fs", &[&d, &m, "-o", "rw"])?;
                let guard = MountGuard::adopt(dir);
                if !sys::is_mounted(dir) {
                    bail!("fuse2fs returned but {m} is not mounted");
                }
                let daemon_pid = find_daemon("fuse2fs", &m);
                Ok(Mounted {
                    dir: dir.to_path_buf(),
                    guard: Some(guard),
                    daemon_pid,
                    kthread_pid: None,
                })
            }
            SysKind::Commitfs(mode) => {
                let pidf = dir.with_extension("pid");
                let _ = std::fs::remove_file(&pidf);
                let mut args = vec!["mount".to_string(), d.clone(), m.clone()];
                args.push("--pid-file".into());
                args.push(pidf.to_string_lossy().into_owned());
                let opts = commitfs_opts(mode.mount_opts);
                if !opts.is_empty() {
                    args.push("-o".into());
                    args.push(opts);
                }
                let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
                sys::run(&commitfs_bin.to_string_lossy(), &a)?;
                let guard = MountGuard::adopt(dir);
                let daemon_pid = std::fs::read_to_string(&pidf)
                    .ok()
                    .and_then(|s| s.trim().parse().ok());
                let _ = std::fs::remove_file(&pidf);
                Ok(Mounted {
                    dir: dir.to_path_buf(),
                    guard: Some(guard),
                    daemon_pid,
                    kthread_pid: None,
                })
            }
        }
    }

    /// Check the file system after unmount: `e2fsck -fn` for ext4 images,
    /// `xfs_repair -n` for XFS. Ok(message) when clean.
    pub fn check(&self, dev: &Path) -> Result<String> {
        let d = dev.to_string_lossy().to_string();
        let (prog, args): (&str, Vec<&str>) = if self.is_ext4_image() {
            ("e2fsck", vec!["-fn", &d])
        } else {
            ("xfs_repair", vec!["-n", &d])
        };
        if !sys::have(prog) {
            return Ok(format!("{prog} not installed: not checked"));
        }
        let out = sys::command(prog)
            .args(&args)
            .output()
            .with_context(|| format!("running {prog}"))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            let tail: Vec<&str> = text.lines().rev().take(8).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "{prog} {}: {}: {}",
                args.join(" "),
                out.status,
                tail.join(" | ")
            );
        }
        Ok(format!("{prog} {}: clean", args.join(" ")))
    }
}

/// Inode tables and the journal are zeroed at mkfs time: the kernel's lazy init
/// thread would otherwise write in the background of the first measurements.
fn ext4_mkfs(dev: &str, features: &str) -> Result<()> {
    sys::run(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-O",
            features,
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0",
            dev,
        ],
    )
    .map(drop)
}

const NOLAZY: &str = "-E lazy_itable_init=0,lazy_journal_init=0";

fn kernel_fs(name: &str) -> Result<()> {
    let f = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if f.lines().any(|l| l.split_whitespace().last() == Some(name)) {
        return Ok(());
    }
    // May be a module not loaded yet.
    let _ = sys::run("modprobe", &[name]);
    let f = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if f.lines().any(|l| l.split_whitespace().last() == Some(name)) {
        Ok(())
    } else {
        Err(anyhow!("the kernel has no {name} support"))
    }
}

fn fuse_ok() -> Result<()> {
    if !Path::new("/dev/fuse").exists() {
        bail!("/dev/fuse missing (modprobe fuse)");
    }
    if !sys::have("fusermount3") {
        bail!("fusermount3 not found (apt-get install fuse3)");
    }
    Ok(())
}

/// The pid of a daemon whose command line names `mountpoint`.
fn find_daemon(comm: &str, mountpoint: &str) -> Option<u32> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(c) = std::fs::read_to_string(format!("/proc/{pid}/comm")) else {
            continue;
        };
        if c.trim_end() != comm {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if cmd.split(|b| *b == 0).any(|a| a == mountpoint.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

/// Journal inode extents and fast-commit length from debugfs/dumpe2fs.
fn ext4_regions(dev: &Path) -> Result<Regions> {
    let d = dev.to_string_lossy().to_string();
    let hdr = sys::run("dumpe2fs", &["-h", &d])?;
    let field = |name: &str| -> Option<u64> {
        hdr.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split(':').nth(1))
            .and_then(|v| v.split_whitespace().next().map(str::to_string))
            .and_then(|v| v.parse().ok())
    };
    let bs = field("Block size").context("dumpe2fs: block size")?;
    let total = field("Total journal blocks").unwrap_or(0);
    let fc_len = field("Fast commit length").unwrap_or(0);
    let stat = sys::run("debugfs", &["-R", "stat <8>", &d])?;
    let ext = parse_extents(&stat);
    if ext.is_empty() {
        bail!("debugfs: no journal extents");
    }
    let mut r = Regions::default();
    let fc_from = total.saturating_sub(fc_len);
    for (l0, l1, p0) in ext {
        // logical l0..=l1 at physical p0..
        r.journal.push((p0 * bs, (p0 + l1 - l0 + 1) * bs));
        if fc_len > 0 && l1 >= fc_from {
            let s = l0.max(fc_from);
            r.fast_commit
                .push(((p0 + s - l0) * bs, (p0 + l1 - l0 + 1) * bs));
        }
    }
    Ok(r)
}

/// `(l0-l1):p0-p1` items of debugfs's EXTENTS section.
pub fn parse_extents(stat: &str) -> Vec<(u64, u64, u64)> {
    let Some(pos) = stat.find("EXTENTS:") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for item in stat[pos + 8..].split([',', '\n']) {
        let item = item.trim();
        let Some(rest) = item.strip_prefix('(') else {
            continue;
        };
        let Some((logical, phys)) = rest.split_once("):") else {
            continue;
        };
        if logical.starts_with("ETB") {
            continue;
        }
        let (l0, l1) = match logical.split_once('-') {
            Some((a, b)) => (a.parse().ok(), b.parse().ok()),
            None => (logical.parse().ok(), logical.parse().ok()),
        };
        let p0 = phys.split('-').next().and_then(|p| p.trim().parse().ok());
        if let (Some(l0), Some(l1), Some(p0)) = (l0, l1, p0) {
            out.push((l0, l1, p0));
        }
    }
    out
}

/// XFS internal log position from xfs_db.
fn xfs_regions(dev: &Path) -> Result<Regions> {
    let d = dev.to_string_lossy().to_string();
    let out = sys::run(
        "xfs_db",
        &[
            "-r",
            "-c",
            "sb 0",
            "-c",
            "p logstart logblocks blocksize agblocks agblklog",
            &d,
        ],
    )?;
    let get = |k: &str| -> Option<u64> {
        out.lines()
            .find(|l| l.trim_start().starts_with(&format!("{k} =")))
            .and_then(|l| l.split('=').nth(1))
            .and_then(|v| v.trim().parse().ok())
    };
    let (Some(ls), Some(lb), Some(bs), Some(agb), Some(agl)) = (
        get("logstart"),
        get("logblocks"),
        get("blocksize"),
        get("agblocks"),
        get("agblklog"),
    ) else {
        bail!("xfs_db: cannot read the log position: {out}");
    };
    let agno = ls >> agl;
    let agbno = ls & ((1u64 << agl) - 1);
    let start = (agno * agb + agbno) * bs;
    Ok(Regions {
        journal: vec![(start, start + lb * bs)],
        fast_commit: Vec::new(),
    })
}

/// A commitfs system's mount options, with `COMMITFS_BENCH_MOUNT_OPTS` (extra
/// options for experiments, e.g. `writeback_cache` or `nocache`; shown in the
/// report's mount column) appended.
pub(crate) fn commitfs_opts(base: &str) -> String {
    let extra = std::env::var("COMMITFS_BENCH_MOUNT_OPTS").unwrap_or_default();
    [base, extra.trim()]
        .iter()
        .filter(|s| !s.is_empty())
        .copied()
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_are_parsed() {
        let s = "Inode: 8 ...\nEXTENTS:\n(0-1023):1000-2023, (1024-2047):5000-6023\n";
        assert_eq!(parse_extents(s), vec![(0, 1023, 1000), (1024, 2047, 5000)]);
        assert!(parse_extents("no extents here").is_empty());
    }

    #[test]
    fn every_commitfs_mode_is_a_system() {
        let s = all_systems();
        for m in commitfs_modes() {
            assert!(s.iter().any(|x| x.id == m.id));
        }
        assert!(s.iter().any(|x| x.id == "ext4") && s.iter().any(|x| x.id == "xfs"));
    }
}
