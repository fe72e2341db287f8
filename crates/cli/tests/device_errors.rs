//! Device faults through the whole stack (issue #9 item 9): `commitfs mount` on an
//! image served by nbdkit whose error filter fails every write while a trigger
//! file exists (`nbdkit --filter=error file IMAGE error-pwrite-file=TRIGGER`),
//! reached through nbdfuse. An fsync acknowledged before the fault survives; the
//! first fsync after it fails with EIO and the mount turns read-only (EROFS) with
//! a clear log line, and stays so when the device heals; after unmount the image
//! recovers with everything fsynced, e2fsck -fn clean, the error recorded.
//!
//! Needs root, /dev/fuse, nbdkit (with its error filter) and nbdfuse (libnbd-bin).

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const BIN: &str = env!("CARGO_BIN_EXE_commitfs");

/// A child process killed (by its pid) and reaped on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// nbdkit serving `image` with the error filter, and nbdfuse exposing it as a
/// file; torn down (FUSE unmount, then the processes, then the files) on drop.
struct ErrDevice {
    disk: PathBuf,
    trigger: PathBuf,
    mnt: PathBuf,
    sock: PathBuf,
    nbdfuse: Option<Proc>,
    nbdkit: Option<Proc>,
    work: Option<TempDir>,
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{what}: not ready after 20 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl ErrDevice {
    fn start(image: &Path) -> ErrDevice {
        let work = TempDir::new("nbderr");
        let mnt = work.path.join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let sock = work.path.join("nbd.sock");
        let trigger = work.path.join("trigger");
        let mut d = ErrDevice {
            disk: mnt.join("disk"),
            trigger,
            mnt,
            sock,
            nbdfuse: None,
            nbdkit: None,
            work: Some(work),
        };
        let nbdkit = Command::new("nbdkit")
            .args(["-f", "--exit-with-parent", "-U"])
            .arg(&d.sock)
            .arg("--filter=error")
            .arg("file")
            .arg(image)
            .args(["error=EIO", "error-pwrite-rate=100%"])
            .arg(format!("error-pwrite-file={}", d.trigger.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nbdkit (apt-get install nbdkit)");
        d.nbdkit = Some(Proc(nbdkit));
        let sock = d.sock.clone();
        wait_until("nbdkit socket", || sock.exists());
        let nbdfuse = Command::new("nbdfuse")
            .arg(&d.disk)
            .arg("--unix")
            .arg(&d.sock)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nbdfuse (apt-get install libnbd-bin)");
        d.nbdfuse = Some(Proc(nbdfuse));
        let (m, disk) = (d.mnt.clone(), d.disk.clone());
        wait_until("nbdfuse mount", || is_mounted(&m, "fuse") && disk.exists());
        d
    }

    fn fail_writes(&self, on: bool) {
        if on {
            File::create(&self.trigger).unwrap();
        } else {
            std::fs::remove_file(&self.trigger).unwrap();
        }
    }
}

impl Drop for ErrDevice {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.trigger);
        for _ in 0..50 {
            if !is_mounted(&self.mnt, "fuse") {
                break;
            }
            if run(Command::new("fusermount3").arg("-u").arg(&self.mnt)).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if is_mounted(&self.mnt, "fuse") {
            let _ = run(Command::new("fusermount3").arg("-uz").arg(&self.mnt));
        }
        self.nbdfuse.take();
        self.nbdkit.take();
        let _ = std::fs::remove_file(&self.sock);
        let _ = std::fs::remove_dir(&self.mnt);
        self.work.take();
    }
}

fn errno_of(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

#[test]
fn nbdkit_write_errors_turn_the_mount_read_only_and_keep_fsynced_data() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root (FUSE mounts of nbdfuse files)");
        return;
    }
    for (prog, pkg) in [("nbdkit", "nbdkit"), ("nbdfuse", "libnbd-bin")] {
        assert!(
            Command::new(prog).arg("--version").output().is_ok(),
            "{prog} missing: apt-get install {pkg}"
        );
    }
    let img = mkfs("nbderr", 64, &[]);
    let dev = ErrDevice::start(&img.path);
    let mut m = FuseMount::mount(
        Path::new(BIN),
        &dev.disk,
        &["-o", "errors=remount-ro,commit=600"],
    )
    .expect("commitfs mount");
    let a_data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    {
        let mut f = File::create(m.path().join("a")).unwrap();
        f.write_all(&a_data).unwrap();
        f.sync_all().expect("fsync before the fault");
    }
    let mut b = File::create(m.path().join("b")).unwrap();
    b.write_all(b"not durable").unwrap();
    dev.fail_writes(true);
    let e = b
        .sync_all()
        .expect_err("fsync while the device fails writes");
    assert_eq!(errno_of(&e), libc::EIO, "{e}");
    drop(b);
    let e = File::create(m.path().join("c")).expect_err("create after the error");
    assert_eq!(errno_of(&e), libc::EROFS, "{e}");
    // The device heals; the mount stays read-only, reads work.
    dev.fail_writes(false);
    let e = std::fs::create_dir(m.path().join("d")).expect_err("mkdir after the error");
    assert_eq!(errno_of(&e), libc::EROFS, "{e}");
    let mut back = Vec::new();
    File::open(m.path().join("a"))
        .unwrap()
        .read_to_end(&mut back)
        .unwrap();
    assert!(back == a_data, "reads keep working");
    let log = m.log_text();
    assert!(
        log.contains("Remounting filesystem read-only"),
        "a clear log line names the switch:\n{log}"
    );
    assert!(log.contains("I/O error"), "and the cause:\n{log}");
    m.unmount().expect("unmount after the error");
    drop(m);
    drop(dev);
    // The image recovers (our replay) with exactly the fsynced state.
    let mut m = FuseMount::mount(Path::new(BIN), &img.path, &[]).expect("remount");
    let mut back = Vec::new();
    File::open(m.path().join("a"))
        .unwrap()
        .read_to_end(&mut back)
        .unwrap();
    assert!(back == a_data, "fsynced data intact after recovery");
    assert!(
        !m.path().join("b").exists(),
        "the file whose fsync failed was never committed"
    );
    m.unmount().expect("unmount");
    check_fsck(&img.path, "the image after the fault").unwrap();
    let raw = std::fs::read(&img.path).unwrap();
    let sb = commitfs_format::superblock::Superblock::parse(&raw[1024..2048]).unwrap();
    assert_ne!(
        sb.state() & commitfs_format::superblock::STATE_ERROR_FS,
        0,
        "the error stays recorded for e2fsck"
    );
    assert!(sb.error_count() >= 1);
}

/// errors=panic: the daemon stops at once (like a kernel panic the mount is left
/// dead: ENOTCONN), writes nothing more, and the image recovers with everything
/// fsynced before.
#[test]
fn nbdkit_write_error_with_errors_panic_stops_the_daemon() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root (FUSE mounts of nbdfuse files)");
        return;
    }
    let img = mkfs("nbdpanic", 64, &[]);
    let dev = ErrDevice::start(&img.path);
    let m = FuseMount::mount(
        Path::new(BIN),
        &dev.disk,
        &["-o", "errors=panic,commit=600"],
    )
    .expect("commitfs mount");
    let a_data: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
    {
        let mut f = File::create(m.path().join("a")).unwrap();
        f.write_all(&a_data).unwrap();
        f.sync_all().expect("fsync before the fault");
    }
    let mut b = File::create(m.path().join("b")).unwrap();
    b.write_all(b"not durable").unwrap();
    dev.fail_writes(true);
    let e = b
        .sync_all()
        .expect_err("fsync while the device fails writes");
    assert!(
        [libc::EIO, libc::ENOTCONN, libc::ECONNABORTED].contains(&errno_of(&e)),
        "{e}"
    );
    drop(b);
    // The daemon is gone: the mount answers nothing any more (ENOTCONN), or a
    // root daemon's sandbox monitor has already detached the dead mount.
    let t = Instant::now();
    loop {
        match std::fs::metadata(m.path().join("a")) {
            Err(e) if errno_of(&e) == libc::ENOTCONN => break,
            _ if !common::is_mounted(m.path(), "fuse") => break,
            r => assert!(
                t.elapsed() < Duration::from_secs(20),
                "the mount still answers after errors=panic: {r:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = m.log_text();
    assert!(log.contains("errors=panic"), "the log says why:\n{log}");
    drop(m);
    dev.fail_writes(false);
    drop(dev);
    let mut m = FuseMount::mount(Path::new(BIN), &img.path, &[]).expect("remount");
    let mut back = Vec::new();
    File::open(m.path().join("a"))
        .unwrap()
        .read_to_end(&mut back)
        .unwrap();
    assert!(back == a_data, "fsynced data intact after recovery");
    assert!(!m.path().join("b").exists());
    m.unmount().expect("unmount");
    check_fsck(&img.path, "the image after errors=panic").unwrap();
}
