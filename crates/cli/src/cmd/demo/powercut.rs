//! The power cut: the mail workload on a fast-commit mount over a
//! [`RecordingDevice`], the power failing in the middle of one fsync (the writes
//! issued since the last flush are lost, torn or kept at random, as a volatile
//! write cache may leave them), then recovery by commitfs and, on a copy, by the
//! kernel; both must keep every message whose fsync returned, and agree.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, ensure, Context, Result};
use commitfs_device::recording::Fate;
use commitfs_device::{CrashLog, CrashSpec, DeviceRef, IoCategory, LogOp, RecordingDevice};
use commitfs_format::superblock::{SUPERBLOCK_OFFSET, SUPERBLOCK_SIZE};
use commitfs_fs::{Fs, MountOptions};
use indicatif::ProgressBar;

use super::rig::{self, Guard};
use super::workload::{read_tree, Lib, Mail, Posix, Target, Verdict};

/// Where and how the demo runs the power cut.
pub struct Setup<'a> {
    pub dir: &'a Path,
    pub mnt: &'a Path,
    pub fuse: bool,
    /// Also let kernel ext4 recover a copy (root, loop devices).
    pub kernel: bool,
    /// Messages delivered; the cut hits the fsync of about three quarters of them.
    pub messages: usize,
}

/// What happened, for the report.
pub struct Report {
    pub delivered: usize,
    /// 1-based number of the fsync the power cut interrupted.
    pub cut_fsync: usize,
    /// That fsync was writing a fast commit (else a full JBD2 commit).
    pub cut_fast: bool,
    pub requests: usize,
    pub cut_at: usize,
    /// Writes issued since the last flush before the cut, and their fates.
    pub in_flight: usize,
    pub lost: usize,
    pub torn: usize,
    pub survived: usize,
    pub recovery: Option<commitfs_fs::Recovery>,
    /// The check of the recovered tree, or what it found missing or wrong.
    pub verdict: std::result::Result<Verdict, String>,
    pub files: usize,
    pub fsck: std::result::Result<(), String>,
    /// The kernel's side: `None` when skipped.
    pub kernel: Option<KernelSide>,
}

pub struct KernelSide {
    /// The kernel's tree equals commitfs's (else the first difference).
    pub same_tree: std::result::Result<(), String>,
    pub fsck: std::result::Result<(), String>,
}

/// Mount options of every commitfs mount here: fast commits on, periodic commits
/// out of the way (only fsyncs commit).
fn opts() -> MountOptions {
    MountOptions {
        commit_interval: 600,
        ..MountOptions::default()
    }
}

/// Serve `fs` to `f` through FUSE at `mnt` (or the library), then unmount.
fn with_mount<T>(
    fs: &Arc<Fs>,
    fuse: bool,
    mnt: &Path,
    name: &str,
    f: impl FnOnce(&mut dyn Target) -> Result<T>,
) -> Result<T> {
    if fuse {
        let m = rig::mount_fuse(fs.clone(), mnt, name)?;
        let r = f(&mut Posix {
            root: mnt.to_path_buf(),
        });
        let u = rig::unmount_fuse(m);
        let r = r?;
        u?;
        Ok(r)
    } else {
        let r = f(&mut Lib { fs: fs.clone() });
        let u = fs.unmount().map_err(|e| anyhow!("unmount: {e}"));
        let r = r?;
        u?;
        Ok(r)
    }
}

/// Writes after the last flush before crash point `k` (neither flushes nor FUA
/// writes: those are durable).
fn volatile_writes(log: &CrashLog, k: usize) -> usize {
    log.ops()[log.durable_prefix(k)..k]
        .iter()
        .filter(|op| matches!(op, LogOp::Write { fua: false, .. }))
        .count()
}

pub fn run(s: &Setup, guard: &mut Guard, pb: &ProgressBar) -> Result<Report> {
    ensure!(s.messages >= 8, "the power cut needs at least 8 messages");
    // A fresh fast-commit image, held in memory by the recording device.
    let base = s.dir.join("powercut-base.img");
    guard.remove_file(&base);
    rig::mkfs(&base, 64, true)?;
    let bytes = std::fs::read(&base).with_context(|| format!("reading {}", base.display()))?;
    let rec = Arc::new(RecordingDevice::new(bytes));
    let dev: DeviceRef = rec.clone();
    let fs = Arc::new(Fs::open(dev, opts()).map_err(|e| anyhow!("mount: {e}"))?);
    let mut mail = Mail::new(0x5EED_0FCA_1100);
    let marks = with_mount(&fs, s.fuse, s.mnt, "commitfs-powercut", |t| {
        mail.setup(t)?;
        mail.run(t, s.messages, &|| rec.op_count() as u64, &|| {
            pb.inc(1);
            rig::interrupted()
        })
    })?;
    drop(fs);
    pb.finish_and_clear();

    // The power fails during fsync `c`, at the request where the most writes are
    // in the device's volatile cache. `c` is near three quarters of the run, an
    // fsync that writes a fast commit after two that did too, so that recovery
    // has fast commits to replay (when there are such runs).
    let sb = SUPERBLOCK_OFFSET..SUPERBLOCK_OFFSET + SUPERBLOCK_SIZE as u64;
    let log = rec.crash_log().with_atomic(vec![sb]);
    let span = |c: usize| (marks[c - 1].0 as usize, marks[c - 1].1 as usize);
    let fast = |c: usize| {
        let (from, to) = span(c);
        log.ops()[from..to].iter().any(|op| {
            matches!(op, LogOp::Write { cat, fua: true, .. } if *cat == IoCategory::FastCommit)
        })
    };
    let aim = s.messages - s.messages / 4;
    let c = (s.messages / 2..s.messages)
        .filter(|&c| c >= 3)
        .min_by_key(|&c| (!(fast(c) && fast(c - 1) && fast(c - 2)), c.abs_diff(aim)))
        .unwrap_or(aim);
    let cut_fast = fast(c);
    let (from, to) = span(c);
    let k = (from + 1..=to)
        .max_by_key(|&k| (volatile_writes(&log, k), k))
        .context("the cut fsync issued no I/O")?;
    let dp = log.durable_prefix(k);
    // Which of those writes reach the media is random (fixed seeds, so the demo
    // is repeatable); take the first seed that loses something.
    let mut pick = None;
    for seed in 0..64u64 {
        let spec = CrashSpec {
            k,
            seed,
            keep_256: 128,
            torn: true,
        };
        let fates = log.fates(&spec);
        let (mut lost, mut torn, mut survived) = (0, 0, 0);
        for (op, f) in log.ops()[dp..k].iter().zip(&fates) {
            if !matches!(op, LogOp::Write { fua: false, .. }) {
                continue;
            }
            match f {
                Fate::Dropped => lost += 1,
                Fate::Torn(_) => torn += 1,
                Fate::Durable => survived += 1,
            }
        }
        let some_loss = lost + torn > 0;
        if some_loss || seed == 63 {
            pick = Some((spec, lost, torn, survived));
            break;
        }
    }
    let (spec, lost, torn, survived) = pick.context("no crash spec")?;
    let image = log.image(&spec);
    drop(log);
    let crash = s.dir.join("crash.img");
    guard.remove_file(&crash);
    std::fs::write(&crash, &image).with_context(|| format!("writing {}", crash.display()))?;
    let kcopy = s.dir.join("crash-kernel.img");
    if s.kernel {
        guard.remove_file(&kcopy);
        std::fs::write(&kcopy, &image).with_context(|| format!("writing {}", kcopy.display()))?;
    }
    drop(image);

    // commitfs recovers the crash image.
    let fs = Arc::new(
        Fs::open_path(&crash, opts()).map_err(|e| anyhow!("commitfs mount after the cut: {e}"))?,
    );
    let recovery = fs.recovery();
    let tree = with_mount(&fs, s.fuse, s.mnt, "commitfs-recovered", read_tree)?;
    drop(fs);
    let verdict = mail.check(&tree, Some(c)).map_err(|e| format!("{e:#}"));
    let fsck = rig::fsck(&crash)?;

    // The kernel recovers its copy.
    let kernel = if s.kernel {
        Some(kernel_side(&kcopy, s.mnt, guard, &tree)?)
    } else {
        None
    };
    Ok(Report {
        delivered: s.messages,
        cut_fsync: c,
        cut_fast,
        requests: rec.op_count(),
        cut_at: k,
        in_flight: volatile_writes(&rec.crash_log(), k),
        lost,
        torn,
        survived,
        recovery,
        verdict,
        files: tree.len(),
        fsck,
        kernel,
    })
}

fn kernel_side(
    image: &Path,
    mnt: &Path,
    guard: &mut Guard,
    ours: &BTreeMap<String, Vec<u8>>,
) -> Result<KernelSide> {
    let dev = guard.losetup(image)?;
    guard
        .mount_kernel(Path::new(&dev), mnt, "rw")
        .context("kernel mount of the crash image (its journal recovery failed?)")?;
    let theirs = read_tree(&mut Posix {
        root: mnt.to_path_buf(),
    });
    guard.umount(mnt)?;
    guard.detach(&dev)?;
    let theirs = theirs.context("reading the kernel's tree")?;
    let same_tree = if &theirs == ours {
        Ok(())
    } else {
        let first = ours
            .iter()
            .find(|(p, d)| theirs.get(*p) != Some(d))
            .map(|(p, _)| format!("{p} differs or is missing in the kernel's tree"))
            .or_else(|| {
                theirs
                    .keys()
                    .find(|p| !ours.contains_key(*p))
                    .map(|p| format!("{p} exists only in the kernel's tree"))
            });
        Err(first.unwrap_or_else(|| "trees differ".into()))
    };
    let fsck = rig::fsck(image)?;
    Ok(KernelSide { same_tree, fsck })
}

/// Print the report; `Err` when something failed.
pub fn print(r: &Report) -> Result<()> {
    println!(
        "   the power failed during fsync #{} of {} ({}), at device request {} of {}:",
        r.cut_fsync,
        r.delivered,
        if r.cut_fast {
            "a fast commit"
        } else {
            "a full JBD2 commit"
        },
        r.cut_at,
        r.requests
    );
    println!(
        "   the device's volatile cache held {} write(s) at that moment ({} lost, {} torn, {} survived)",
        r.in_flight, r.lost, r.torn, r.survived
    );
    match &r.recovery {
        Some(rc) => {
            let fc = rc
                .fast_commits
                .as_ref()
                .map(|f| format!(" and {} fast commits ({} records)", f.commits, f.applied))
                .unwrap_or_else(|| ", no fast commits after them".into());
            println!(
                "   commitfs recovery: replayed {} JBD2 transactions ({} blocks){fc}",
                rc.journal.transactions, rc.journal.blocks_replayed
            );
        }
        None => println!("   commitfs recovery: the journal was empty (nothing to replay)"),
    }
    let mut failed = Vec::new();
    match &r.verdict {
        Ok(v) => {
            println!(
                "   fsynced messages: all {} that must survive are there byte for byte \
                 ({} renamed before the cut: {} under the new name, {} the old)",
                v.intact,
                v.renamed_new + v.renamed_old,
                v.renamed_new,
                v.renamed_old
            );
            println!(
                "   deleted before the cut: {} gone, {} still there; the message being fsynced: {}",
                v.deleted_gone,
                v.deleted_kept,
                v.in_flight.unwrap_or("-")
            );
        }
        Err(e) => {
            println!("   fsynced messages: LOST after commitfs's recovery: {e}");
            failed.push("fsynced messages lost");
        }
    }
    match &r.fsck {
        Ok(()) => println!("   e2fsck -fn after commitfs's recovery: clean"),
        Err(e) => {
            println!("   e2fsck -fn after commitfs's recovery: PROBLEMS\n{e}");
            failed.push("e2fsck after commitfs's recovery");
        }
    }
    match &r.kernel {
        None => {}
        Some(k) => {
            match &k.same_tree {
                Ok(()) => println!(
                    "   kernel ext4 on a copy: mounted (journal replayed), same tree as commitfs ({} files, every byte)",
                    r.files
                ),
                Err(e) => {
                    println!("   kernel ext4 on a copy: DIFFERENT tree: {e}");
                    failed.push("kernel tree");
                }
            }
            match &k.fsck {
                Ok(()) => println!("   e2fsck -fn after the kernel's recovery: clean"),
                Err(e) => {
                    println!("   e2fsck -fn after the kernel's recovery: PROBLEMS\n{e}");
                    failed.push("e2fsck after the kernel's recovery");
                }
            }
        }
    }
    if !failed.is_empty() {
        bail!("power cut: {}", failed.join(", "));
    }
    Ok(())
}
