//! Benchmark (not a test): N x (create, append 4 KiB, fsync) in one directory, on one
//! loop device, for kernel ext4 and commitfs (library and FUSE). Device counts come
//! from `/sys/block/loopN/stat` (writes, sectors, flushes), never from the system
//! under test. Needs root.
//!
//! cargo run --release --example fsync_bench -- [N] [extra mkfs -O features]
//! e.g. `fsync_bench 1024 ^fast_commit` (the JBD2 comparison) or
//! `fsync_bench 1024 fast_commit`.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use commitfs::{Fs, MountOptions, ROOT_INO};

#[derive(Debug, Clone, Copy, Default)]
struct LoopStat {
    writes: u64,
    write_sectors: u64,
    flushes: u64,
}

fn loop_stat(dev: &str) -> LoopStat {
    let name = Path::new(dev).file_name().unwrap().to_string_lossy();
    let s = std::fs::read_to_string(format!("/sys/block/{name}/stat")).unwrap();
    let v: Vec<u64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();
    LoopStat {
        writes: v[4],
        write_sectors: v[6],
        flushes: v.get(15).copied().unwrap_or(0),
    }
}

fn sh(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn mkfs(dev: &str, features: &str) {
    let mut args = vec!["-q", "-F"];
    if !features.is_empty() {
        args.push("-O");
        args.push(features);
    }
    args.push(dev);
    sh("mkfs.ext4", &args);
    sh("sync", &[]);
}

fn posix_workload(dir: &Path, n: usize) -> f64 {
    let block = vec![0x5Au8; 4096];
    let t = Instant::now();
    for i in 0..n {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o644)
            .open(dir.join(format!("f{i}")))
            .unwrap();
        f.write_all(&block).unwrap();
        f.sync_all().unwrap();
    }
    t.elapsed().as_secs_f64()
}

struct Row {
    system: String,
    secs: f64,
    d: LoopStat,
    journal_bytes: Option<u64>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let features = args
        .get(2)
        .cloned()
        .unwrap_or_else(|| "^fast_commit".into());
    let img = PathBuf::from(format!(
        "/tmp/commitfs-fsync-bench-{}.img",
        std::process::id()
    ));
    std::fs::File::create(&img)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let dev = sh("losetup", &["-f", "--show", img.to_str().unwrap()]);
    let mnt = PathBuf::from(format!(
        "/tmp/commitfs-fsync-bench-{}.mnt",
        std::process::id()
    ));
    std::fs::create_dir_all(&mnt).unwrap();
    let mut rows = Vec::new();

    // Kernel ext4.
    mkfs(&dev, &features);
    sh("mount", &["-t", "ext4", &dev, mnt.to_str().unwrap()]);
    std::fs::create_dir(mnt.join("d")).unwrap();
    sh("sync", &[]);
    let s0 = loop_stat(&dev);
    let secs = posix_workload(&mnt.join("d"), n);
    let s1 = loop_stat(&dev);
    sh("umount", &[mnt.to_str().unwrap()]);
    rows.push(Row {
        system: format!("kernel ext4 (-O {features})"),
        secs,
        d: LoopStat {
            writes: s1.writes - s0.writes,
            write_sectors: s1.write_sectors - s0.write_sectors,
            flushes: s1.flushes - s0.flushes,
        },
        journal_bytes: None,
    });

    // commitfs library on the same loop device.
    mkfs(&dev, &features);
    {
        let d: commitfs::device::DeviceRef =
            Arc::new(commitfs::device::FileDevice::open(Path::new(&dev), false).unwrap());
        let fs = Fs::open(d, MountOptions::default()).unwrap();
        let dir = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap();
        fs.sync().unwrap();
        let s0 = loop_stat(&dev);
        let j0 = fs.stats();
        let block = vec![0x5Au8; 4096];
        let t = Instant::now();
        for i in 0..n {
            let a = fs
                .create(dir.ino, format!("f{i}").as_bytes(), 0o644, 0, 0)
                .unwrap();
            fs.write(a.ino, 0, &block).unwrap();
            fs.fsync(a.ino, false).unwrap();
        }
        let secs = t.elapsed().as_secs_f64();
        let s1 = loop_stat(&dev);
        let j1 = fs.stats();
        rows.push(Row {
            system: format!(
                "commitfs library ({} fast commits, {} full commits)",
                fs.fc_stats().commits,
                j1.journal.commits - j0.journal.commits
            ),
            secs,
            d: LoopStat {
                writes: s1.writes - s0.writes,
                write_sectors: s1.write_sectors - s0.write_sectors,
                flushes: s1.flushes - s0.flushes,
            },
            journal_bytes: Some(
                j1.device.journal.write_bytes - j0.device.journal.write_bytes
                    + j1.device.fast_commit.write_bytes
                    - j0.device.fast_commit.write_bytes,
            ),
        });
        fs.unmount().unwrap();
    }

    // commitfs through FUSE on the same loop device.
    mkfs(&dev, &features);
    let bin = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("commitfs");
    let st = Command::new(&bin)
        .args(["mount", &dev, mnt.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(
        st.success(),
        "commitfs mount failed (build the binary first)"
    );
    std::fs::create_dir(mnt.join("d")).unwrap();
    sh("sync", &["-f", mnt.to_str().unwrap()]);
    let s0 = loop_stat(&dev);
    let secs = posix_workload(&mnt.join("d"), n);
    let s1 = loop_stat(&dev);
    sh("umount", &[mnt.to_str().unwrap()]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    rows.push(Row {
        system: "commitfs FUSE".into(),
        secs,
        d: LoopStat {
            writes: s1.writes - s0.writes,
            write_sectors: s1.write_sectors - s0.write_sectors,
            flushes: s1.flushes - s0.flushes,
        },
        journal_bytes: None,
    });

    sh("losetup", &["-d", &dev]);
    let _ = std::fs::remove_dir(&mnt);
    let _ = std::fs::remove_file(&img);

    println!("{n} x (create, append 4 KiB, fsync) on {dev}, mkfs -O {features}");
    println!(
        "| system | fsyncs/s | device writes/fsync | device KiB/fsync | flushes/fsync | journal+fc KiB/fsync |"
    );
    println!("|---|---|---|---|---|---|");
    for r in rows {
        let nf = n as f64;
        println!(
            "| {} | {:.0} | {:.2} | {:.1} | {:.2} | {} |",
            r.system,
            nf / r.secs,
            r.d.writes as f64 / nf,
            r.d.write_sectors as f64 / 2.0 / nf,
            r.d.flushes as f64 / nf,
            r.journal_bytes
                .map(|b| format!("{:.1}", b as f64 / 1024.0 / nf))
                .unwrap_or_else(|| "-".into())
        );
    }
}
