//! `commitfs demo [--dir DIR] [--keep] [--messages N]`: what commitfs is for, in
//! under a minute.
//!
//! 1. An fsync-heavy mail-delivery loop through a FUSE mount of commitfs in its
//!    three commit modes (JBD2 only, fast commit, fast commit + `fc_data_csum`)
//!    and, as root, kernel ext4 with and without fast commits, all on one loop
//!    device whose block-layer counters (`/sys/block/loopN/stat`) judge every
//!    system alike: fsyncs per second, device writes, KiB and flushes per fsync.
//!    Each run's tree is verified and its image checked by `e2fsck -fn`.
//! 2. A power cut ([`powercut`]) in the middle of an fsync, recovery by commitfs
//!    and by the kernel, and proof that every fsynced message survived.
//!
//! Without root the kernel runs are skipped (and commitfs's counts come from the
//! device crate's counters on an image file); without FUSE the workload runs
//! through the library API. The demo says which and why.

mod powercut;
mod rig;
mod workload;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use commitfs_fs::{Fs, MountOptions};
use indicatif::{ProgressBar, ProgressStyle};

use rig::{Counts, Guard};
use workload::{read_tree, Lib, Mail, Posix, Target};

/// Default number of messages (one fsync each) per system.
pub const DEFAULT_MESSAGES: usize = 300;

/// Image size of the measured runs.
const IMAGE_MIB: u64 = 256;

/// One system of the table.
#[derive(Clone, Copy)]
enum System {
    Commitfs { fast_commit: bool, csum: bool },
    Kernel { fast_commit: bool },
}

impl System {
    fn label(self) -> &'static str {
        match self {
            System::Commitfs {
                fast_commit: false, ..
            } => "commitfs JBD2 (nofast_commit)",
            System::Commitfs { csum: false, .. } => "commitfs fast commit",
            System::Commitfs { .. } => "commitfs fast commit+fc_data_csum",
            System::Kernel { fast_commit: false } => "kernel ext4 JBD2",
            System::Kernel { .. } => "kernel ext4 fast_commit",
        }
    }
    fn fast_commit(self) -> bool {
        match self {
            System::Commitfs { fast_commit, .. } | System::Kernel { fast_commit } => fast_commit,
        }
    }
}

/// One measured run.
struct Row {
    label: &'static str,
    fsyncs: u64,
    secs: f64,
    c: Counts,
    /// Tree verified and `e2fsck -fn` clean, else what failed.
    check: std::result::Result<(), String>,
}

impl Row {
    fn print(&self) {
        let n = self.fsyncs.max(1) as f64;
        println!(
            "   {:<34} {:>9.0} {:>13.2} {:>10.1} {:>14.2}  {}",
            self.label,
            self.fsyncs as f64 / self.secs.max(1e-9),
            self.c.writes as f64 / n,
            self.c.bytes as f64 / 1024.0 / n,
            self.c.flushes as f64 / n,
            if self.check.is_ok() { "ok" } else { "FAILED" }
        );
    }
}

/// Where a run's file system lives and how its I/O is counted.
struct Bench<'a> {
    /// `/dev/loopN` (counted by the block layer) or `None` (an image file per run,
    /// counted by the device crate).
    loopdev: Option<&'a str>,
    image: &'a Path,
    mnt: &'a Path,
    fuse: bool,
    messages: usize,
}

impl Bench<'_> {
    fn target(&self) -> PathBuf {
        match self.loopdev {
            Some(d) => PathBuf::from(d),
            None => self.image.to_path_buf(),
        }
    }

    fn run(&self, sys: System, guard: &mut Guard, pb: &ProgressBar) -> Result<Row> {
        let target = self.target();
        rig::mkfs(&target, IMAGE_MIB, sys.fast_commit())?;
        let mut mail = Mail::new(0xDE30_0000 ^ self.messages as u64);
        let tick = || {
            pb.inc(1);
            rig::interrupted()
        };
        let (secs, c, tree) = match sys {
            System::Kernel { .. } => {
                let dev = self.loopdev.context("kernel runs need a loop device")?;
                // Periodic commits out of the way: every write is an fsync's.
                guard.mount_kernel(&target, self.mnt, "commit=600")?;
                let mut t = Posix {
                    root: self.mnt.to_path_buf(),
                };
                let r = measure(
                    &mut mail,
                    &mut t,
                    self.messages,
                    &|| rig::disk_counts(dev),
                    &tick,
                );
                guard.umount(self.mnt)?;
                r?
            }
            System::Commitfs { fast_commit, csum } => {
                let opts = MountOptions {
                    commit_interval: 600,
                    fast_commit,
                    fc_data_csum: csum,
                    ..MountOptions::default()
                };
                let fs = Arc::new(
                    Fs::open_path(&target, opts)
                        .map_err(|e| anyhow!("opening {}: {e}", target.display()))?,
                );
                let counts = || match self.loopdev {
                    Some(d) => rig::disk_counts(d),
                    None => Ok(rig::fs_counts(&fs)),
                };
                let r = if self.fuse {
                    let m = rig::mount_fuse(fs.clone(), self.mnt, sys.label())?;
                    let mut t = Posix {
                        root: self.mnt.to_path_buf(),
                    };
                    let r = measure(&mut mail, &mut t, self.messages, &counts, &tick);
                    rig::unmount_fuse(m).and(r)
                } else {
                    let mut t = Lib { fs: fs.clone() };
                    let r = measure(&mut mail, &mut t, self.messages, &counts, &tick);
                    fs.unmount().map_err(|e| anyhow!("unmount: {e}")).and(r)
                };
                drop(fs);
                r?
            }
        };
        let check = mail
            .check(&tree, None)
            .map(|_| ())
            .map_err(|e| format!("{e:#}"))
            .and(rig::fsck(&target)?);
        Ok(Row {
            label: sys.label(),
            fsyncs: self.messages as u64,
            secs,
            c,
            check,
        })
    }
}

/// Set up, deliver `n` messages inside the counting window, read the tree back.
fn measure(
    mail: &mut Mail,
    t: &mut dyn Target,
    n: usize,
    counts: &dyn Fn() -> Result<Counts>,
    tick: &dyn Fn() -> Result<()>,
) -> Result<(f64, Counts, std::collections::BTreeMap<String, Vec<u8>>)> {
    mail.setup(t)?;
    let c0 = counts()?;
    let t0 = Instant::now();
    mail.run(t, n, &|| 0, tick)?;
    let secs = t0.elapsed().as_secs_f64();
    let c = counts()?.since(c0);
    let tree = read_tree(t)?;
    Ok((secs, c, tree))
}

fn progress(n: usize, what: &str) -> ProgressBar {
    // Drawn on stderr only when it is a terminal; no colours.
    let pb = ProgressBar::new(n as u64);
    pb.set_style(
        ProgressStyle::with_template("   {prefix:<34} [{bar:30}] {pos}/{len} fsyncs")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_prefix(what.to_string());
    pb
}

/// `commitfs demo`.
pub fn run(dir: Option<&Path>, keep: bool, messages: usize) -> Result<()> {
    if messages < 8 {
        bail!("--messages must be at least 8");
    }
    // The README's first command on a fresh machine: the only package the demo
    // needs beyond the base system is e2fsprogs (mkfs.ext4 makes its images,
    // e2fsck judges them). As root, install it; otherwise say so.
    if ["mkfs.ext4", "e2fsck"].iter().any(|t| !rig::have_tool(t)) {
        if rig::is_root() && rig::have_tool("apt-get") {
            eprintln!("demo: installing e2fsprogs (mkfs.ext4, e2fsck)");
            let ok = std::process::Command::new("apt-get")
                .args(["-qq", "update"])
                .status()
                .is_ok_and(|s| s.success())
                && std::process::Command::new("apt-get")
                    .args(["-y", "-qq", "install", "e2fsprogs"])
                    .env("DEBIAN_FRONTEND", "noninteractive")
                    .status()
                    .is_ok_and(|s| s.success());
            if !ok {
                bail!("could not install e2fsprogs (apt-get failed)");
            }
        }
        for t in ["mkfs.ext4", "e2fsck"] {
            if !rig::have_tool(t) {
                bail!("{t} not found: install e2fsprogs (as root the demo does it itself)");
            }
        }
    }
    rig::install_interrupt();
    let t0 = Instant::now();
    let mut guard = Guard::default();
    guard.keep = keep;
    let dir = match dir {
        Some(d) => {
            if !d.exists() {
                std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
                guard.remove_dir(d);
            }
            std::fs::canonicalize(d)?
        }
        None => {
            let d = std::env::temp_dir().join(format!(
                "commitfs-demo-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.subsec_nanos())
                    .unwrap_or(0)
            ));
            std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
            guard.remove_dir(&d);
            d
        }
    };
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt)?;
    guard.remove_dir(&mnt);
    let image = dir.join("bench.img");
    guard.remove_file(&image);

    println!("commitfs demo in {}", dir.display());
    let mut no_fuse = rig::fuse_unavailable();
    if no_fuse.is_none() {
        if let Err(e) = rig::probe_fuse(&dir, &mnt)? {
            no_fuse = Some(e);
        }
    }
    let mut no_kernel = rig::kernel_unavailable();
    match &no_fuse {
        None => println!("   commitfs runs through a FUSE mount"),
        Some(why) => println!(
            "   NOTE: FUSE unavailable ({why}): commitfs runs through the library API instead"
        ),
    }
    // One loop device for every system, so one instrument counts them all.
    let mut loopdev = None;
    if no_kernel.is_none() {
        rig::mkfs(&image, IMAGE_MIB, false)?;
        match guard.losetup(&image) {
            Ok(d) => loopdev = Some(d),
            Err(e) => no_kernel = Some(format!("no loop device: {e:#}")),
        }
    }
    if let Some(why) = &no_kernel {
        println!("   NOTE: kernel ext4 skipped ({why})");
    }

    println!();
    println!(
        "1. Mail delivery, fsync-heavy: {messages} messages of 4-16 KiB, each created, written and \
         fsynced;"
    );
    println!(
        "   every 3rd marks one read (rename), every 4th deletes one. Periodic commits off \
         (commit=600)."
    );
    match &loopdev {
        Some(d) => println!(
            "   Counted at the device for every system alike: {d} (/sys/block/{}/stat).",
            d.trim_start_matches("/dev/")
        ),
        None => println!(
            "   Counted by commitfs's device layer on an image file (a FUA write counts as a flush)."
        ),
    }
    println!(
        "   {:<34} {:>9} {:>13} {:>10} {:>14}  check",
        "system", "fsyncs/s", "writes/fsync", "KiB/fsync", "flushes/fsync"
    );
    let mut systems = vec![
        System::Commitfs {
            fast_commit: false,
            csum: false,
        },
        System::Commitfs {
            fast_commit: true,
            csum: false,
        },
        System::Commitfs {
            fast_commit: true,
            csum: true,
        },
    ];
    if loopdev.is_some() {
        systems.push(System::Kernel { fast_commit: false });
        systems.push(System::Kernel { fast_commit: true });
    }
    let bench = Bench {
        loopdev: loopdev.as_deref(),
        image: &image,
        mnt: &mnt,
        fuse: no_fuse.is_none(),
        messages,
    };
    let mut failures = Vec::new();
    for sys in systems {
        rig::interrupted()?;
        let pb = progress(messages, sys.label());
        let row = bench.run(sys, &mut guard, &pb);
        pb.finish_and_clear();
        let row = row.with_context(|| sys.label())?;
        row.print();
        if let Err(e) = &row.check {
            println!("   {}: {e}", row.label);
            failures.push(row.label.to_string());
        }
    }
    if let Some(d) = &loopdev {
        guard.detach(d)?;
    }

    println!();
    let pc_messages = (messages / 2).max(8);
    println!(
        "2. Power cut: {pc_messages} more messages on a fast-commit mount over a device that keeps \
         only flushed and FUA writes;"
    );
    println!(
        "   the power fails in the middle of an fsync, then {} the image.",
        if loopdev.is_some() {
            "commitfs and, on a copy, kernel ext4 recover"
        } else {
            "commitfs recovers"
        }
    );
    let pb = progress(pc_messages, "commitfs fast commit (recorded)");
    let report = powercut::run(
        &powercut::Setup {
            dir: &dir,
            mnt: &mnt,
            fuse: no_fuse.is_none(),
            kernel: loopdev.is_some(),
            messages: pc_messages,
        },
        &mut guard,
        &pb,
    );
    pb.finish_and_clear();
    let report = report.context("power cut")?;
    if let Err(e) = powercut::print(&report) {
        failures.push(format!("{e:#}"));
    }
    if report.kernel.is_none() {
        println!(
            "   kernel recovery skipped ({})",
            no_kernel.as_deref().unwrap_or("no loop device")
        );
    }

    println!();
    println!("   time: {:.1} s", t0.elapsed().as_secs_f64());
    if keep {
        println!("   kept the images in {}", dir.display());
    }
    drop(guard);
    if !failures.is_empty() {
        println!("demo: FAIL");
        bail!("failed: {}", failures.join("; "));
    }
    println!("demo: PASS");
    Ok(())
}
