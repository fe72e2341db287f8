//! The mount daemon's sandbox (crates/cli/src/sandbox.rs) through the real binary:
//! the serving process is unprivileged (non-root uid, no capabilities, seccomp,
//! no_new_privs) by default and root with `-o keep_privileges`; a sandboxed daemon
//! still serves every operation class (kernel ext4 reads back what it wrote) and
//! unmounts on SIGTERM (to either process) and on `umount`. Needs root and
//! /dev/fuse.

mod common;

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use commitfs_fs::testutil::mkfs;
use common::{
    check_fsck, cpath, is_mounted, posix_get_xattr, set_xattr, unique_path, FuseMount, KernelMount,
    TempDir,
};

const BIN: &str = env!("CARGO_BIN_EXE_commitfs");

fn bin() -> &'static Path {
    Path::new(BIN)
}

/// The `Name:` fields of /proc/PID[/task/TID]/status.
fn status(path: &Path) -> std::collections::HashMap<String, String> {
    fs::read_to_string(path.join("status"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

fn proc_dir(pid: u32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}"))
}

/// Children of `pid` (scanning /proc, no CONFIG_PROC_CHILDREN needed).
fn children(pid: u32) -> Vec<u32> {
    let mut v = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let st = status(&e.path());
        if st.get("PPid").map(String::as_str) == Some(&pid.to_string()) {
            v.push(p);
        }
    }
    v
}

fn ids(field: &str) -> Vec<u32> {
    field
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect()
}

/// Assert that the process and every one of its threads is sandboxed. The mount
/// is visible a moment before the worker drops root (requests wait for it): poll.
fn assert_sandboxed(pid: u32, uid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while status(&proc_dir(pid)).get("Seccomp").map(String::as_str) != Some("2")
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    let tasks: Vec<PathBuf> = fs::read_dir(proc_dir(pid).join("task"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(tasks.len() > 1, "the worker has its threads");
    let mut checked = 0;
    for t in &tasks {
        let st = status(t);
        if st.is_empty() {
            // The thread ended between the listing and this read (a
            // short-lived helper thread): nothing left to check.
            continue;
        }
        checked += 1;
        let what = format!("{} ({:?})", t.display(), st.get("Name"));
        assert_eq!(ids(&st["Uid"]), vec![uid; 4], "{what}: uids");
        assert!(ids(&st["Gid"]).iter().all(|&g| g != 0), "{what}: gids");
        assert_eq!(st["Groups"], "", "{what}: supplementary groups");
        for cap in ["CapInh", "CapPrm", "CapEff", "CapAmb"] {
            assert_eq!(
                u64::from_str_radix(&st[cap], 16).unwrap(),
                0,
                "{what}: {cap}"
            );
        }
        assert_eq!(st["NoNewPrivs"], "1", "{what}: no_new_privs");
        assert_eq!(st["Seccomp"], "2", "{what}: seccomp filter mode");
    }
    assert!(checked > 1, "the worker's threads were checked ({checked})");
    // The bounding set is per thread: the main thread dropped it.
    let st = status(&proc_dir(pid));
    assert_eq!(u64::from_str_radix(&st["CapBnd"], 16).unwrap(), 0, "CapBnd");
}

fn assert_root(pid: u32, what: &str) {
    let st = status(&proc_dir(pid));
    assert_eq!(ids(&st["Uid"]), vec![0; 4], "{what}: uids");
    assert_ne!(
        u64::from_str_radix(&st["CapEff"], 16).unwrap(),
        0,
        "{what}: capabilities"
    );
    assert_eq!(st["Seccomp"], "0", "{what}: no seccomp");
}

fn the_worker(monitor: u32) -> u32 {
    let c = children(monitor);
    assert_eq!(
        c.len(),
        1,
        "the monitor {monitor} has one child (the worker): {c:?}"
    );
    c[0]
}

#[test]
fn serving_process_drops_root_by_default_and_keeps_it_on_request() {
    let img = mkfs("sbx-ids", 32, &[]);

    let mut m = FuseMount::mount(bin(), &img.path, &[]).unwrap();
    let monitor = m.pid().unwrap();
    let worker = the_worker(monitor);
    assert_sandboxed(worker, 65534);
    assert_root(monitor, "monitor");
    fs::write(m.path().join("f"), b"x").unwrap();
    m.unmount().unwrap();
    assert_eq!(
        status(&proc_dir(worker)).get("Name"),
        None,
        "the worker exited"
    );

    let mut m = FuseMount::mount(bin(), &img.path, &["-o", "sandbox_user=4242"]).unwrap();
    assert_sandboxed(the_worker(m.pid().unwrap()), 4242);
    m.unmount().unwrap();

    let mut m = FuseMount::mount(bin(), &img.path, &["-o", "keep_privileges"]).unwrap();
    let pid = m.pid().unwrap();
    assert_root(pid, "keep_privileges daemon");
    assert!(children(pid).is_empty(), "no monitor/worker split");
    m.unmount().unwrap();

    let out = Command::new(BIN)
        .args(["mount", "-o", "sandbox_user=no-such-user-here"])
        .arg(&img.path)
        .arg(std::env::temp_dir())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no-such-user-here"),
        "{err}"
    );
    check_fsck(&img.path, "after the mounts").unwrap();
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

#[test]
fn sandboxed_daemon_serves_every_operation_class() {
    common::umask0();
    let img = mkfs("sbx-ops", 64, &["-O", "fast_commit"]);
    let mut m = FuseMount::mount(bin(), &img.path, &[]).unwrap();
    assert_sandboxed(the_worker(m.pid().unwrap()), 65534);
    let d = m.path().to_path_buf();
    let p = |s: &str| d.join(s);

    // create, write, fsync, read
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut f = File::create(p("file")).unwrap();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    f.sync_data().unwrap();
    drop(f);
    assert_eq!(fs::read(p("file")).unwrap(), data);
    // mkdir, rename, link, symlink, readlink
    fs::create_dir(p("dir")).unwrap();
    fs::rename(p("file"), p("dir/renamed")).unwrap();
    fs::hard_link(p("dir/renamed"), p("hard")).unwrap();
    assert_eq!(fs::metadata(p("hard")).unwrap().nlink(), 2);
    std::os::unix::fs::symlink("dir/renamed", p("sym")).unwrap();
    assert_eq!(fs::read_link(p("sym")).unwrap(), Path::new("dir/renamed"));
    // mknod: a character device and a fifo
    let dev = libc::makedev(1, 3);
    // SAFETY: valid NUL-terminated paths.
    unsafe {
        assert_eq!(
            libc::mknod(cpath(&p("null")).as_ptr(), libc::S_IFCHR | 0o644, dev),
            0,
            "{}",
            errno()
        );
        assert_eq!(
            libc::mkfifo(cpath(&p("fifo")).as_ptr(), 0o600),
            0,
            "{}",
            errno()
        );
    }
    assert!(fs::metadata(p("null"))
        .unwrap()
        .file_type()
        .is_char_device());
    // chmod (setuid, which the daemon stores as plain metadata), chown to others
    fs::write(p("suid"), b"#!/bin/sh\n").unwrap();
    fs::set_permissions(p("suid"), fs::Permissions::from_mode(0o4755)).unwrap();
    std::os::unix::fs::chown(p("suid"), Some(1000), Some(1000)).unwrap();
    let md = fs::metadata(p("suid")).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o755, "chown clears setuid");
    fs::set_permissions(p("suid"), fs::Permissions::from_mode(0o4755)).unwrap();
    assert_eq!(fs::metadata(p("suid")).unwrap().mode() & 0o7777, 0o4755);
    std::os::unix::fs::chown(p("dir/renamed"), Some(1000), Some(1001)).unwrap();
    let md = fs::metadata(p("dir/renamed")).unwrap();
    assert_eq!((md.uid(), md.gid()), (1000, 1001));
    // xattrs: set, get, list (via the common helpers), remove
    set_xattr(&p("dir/renamed"), "user.k", b"value");
    set_xattr(&p("dir/renamed"), "trusted.big", &[b'b'; 900]);
    assert_eq!(
        posix_get_xattr(&p("dir/renamed"), b"user.k").unwrap(),
        b"value"
    );
    let names = common::posix_list_xattrs(&p("dir/renamed")).unwrap();
    assert!(names.contains_key(b"trusted.big".as_slice()), "{names:?}");
    let n = CString::new("trusted.big").unwrap();
    // SAFETY: valid NUL-terminated strings.
    assert_eq!(
        unsafe { libc::removexattr(cpath(&p("dir/renamed")).as_ptr(), n.as_ptr()) },
        0
    );
    // truncate, fallocate
    let f = OpenOptions::new().write(true).open(p("hard")).unwrap();
    f.set_len(100_000).unwrap();
    // SAFETY: a valid descriptor.
    assert_eq!(
        unsafe { libc::fallocate(f.as_raw_fd(), 0, 200_000, 65536) },
        0,
        "{}",
        errno()
    );
    drop(f);
    assert_eq!(fs::metadata(p("hard")).unwrap().len(), 265_536);
    // statfs
    // SAFETY: statvfs into a zeroed struct.
    let mut sv: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(cpath(&d).as_ptr(), &mut sv) }, 0);
    assert!(sv.f_blocks > 0 && sv.f_bfree > 0);
    // readdir, unlink, rmdir
    fs::create_dir(p("gone")).unwrap();
    fs::write(p("gone/x"), b"x").unwrap();
    fs::remove_file(p("gone/x")).unwrap();
    fs::remove_dir(p("gone")).unwrap();
    let mut names: Vec<String> = fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["dir", "fifo", "hard", "lost+found", "null", "suid", "sym"]
    );
    // The stats socket still answers.
    let out = Command::new(BIN).arg("stats").arg(&d).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    m.unmount().unwrap();

    check_fsck(&img.path, "after the sandboxed mount").unwrap();
    // The kernel reads back what the sandboxed daemon wrote.
    let k = KernelMount::mount(&img.path, "ro").unwrap();
    let kp = |s: &str| k.path().join(s);
    let mut got = Vec::new();
    File::open(kp("hard"))
        .unwrap()
        .read_to_end(&mut got)
        .unwrap();
    assert_eq!(got.len(), 265_536);
    assert_eq!(&got[..100_000], &data[..100_000]);
    assert!(got[100_000..].iter().all(|&b| b == 0));
    let md = fs::metadata(kp("dir/renamed")).unwrap();
    assert_eq!((md.uid(), md.gid(), md.nlink()), (1000, 1001, 2));
    assert_eq!(
        posix_get_xattr(&kp("dir/renamed"), b"user.k").unwrap(),
        b"value"
    );
    assert!(posix_get_xattr(&kp("dir/renamed"), b"trusted.big").is_err());
    assert_eq!(fs::metadata(kp("suid")).unwrap().mode() & 0o7777, 0o4755);
    let md = fs::symlink_metadata(kp("null")).unwrap();
    assert!(md.file_type().is_char_device() && md.rdev() == dev);
    assert!(fs::symlink_metadata(kp("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(fs::read_link(kp("sym")).unwrap(), Path::new("dir/renamed"));
}

/// A daemon-mode mount (no --foreground) with a pid file; unmounted lazily on drop.
struct Daemon {
    dir: TempDir,
    pid_file: PathBuf,
}

impl Daemon {
    fn mount(image: &Path) -> Daemon {
        let dir = TempDir::new("sbx-dmnt");
        let pid_file = unique_path("sbx-pid");
        let out = Command::new(BIN)
            .arg("mount")
            .arg(image)
            .arg(&dir.path)
            .arg("--pid-file")
            .arg(&pid_file)
            .output()
            .unwrap();
        let d = Daemon { dir, pid_file };
        assert!(
            out.status.success(),
            "mount: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(is_mounted(&d.dir.path, "fuse"));
        d
    }
    fn pid(&self) -> u32 {
        fs::read_to_string(&self.pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if is_mounted(&self.dir.path, "fuse") {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&self.dir.path)
                .status();
        }
        let _ = fs::remove_file(&self.pid_file);
    }
}

/// Gone or a zombie (not our child: the test cannot reap it).
fn wait_gone(pid: u32, secs: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        match status(&proc_dir(pid)).get("State") {
            None => return true,
            Some(s) if s.starts_with('Z') || s.starts_with('X') => return true,
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    false
}

#[test]
fn sandboxed_daemon_unmounts_on_sigterm_to_either_process_and_on_umount() {
    let img = mkfs("sbx-term", 32, &[]);
    for how in [
        "SIGTERM to the pid file's process",
        "SIGTERM to the worker",
        "umount",
    ] {
        let d = Daemon::mount(&img.path);
        let monitor = d.pid();
        // The pid file names the privileged process that exits last.
        assert_root(monitor, how);
        let worker = the_worker(monitor);
        assert_sandboxed(worker, 65534);
        fs::write(d.dir.path.join(how), how).unwrap();
        match how {
            "umount" => assert!(Command::new("umount")
                .arg(&d.dir.path)
                .status()
                .unwrap()
                .success()),
            // SAFETY: signalling processes this test started.
            "SIGTERM to the worker" => {
                assert_eq!(unsafe { libc::kill(worker as i32, libc::SIGTERM) }, 0)
            }
            _ => assert_eq!(unsafe { libc::kill(monitor as i32, libc::SIGTERM) }, 0),
        }
        assert!(
            wait_gone(worker, 60),
            "{how}: worker {worker} still running"
        );
        assert!(
            wait_gone(monitor, 10),
            "{how}: monitor {monitor} still running"
        );
        assert!(!is_mounted(&d.dir.path, "fuse"), "{how}: still mounted");
        drop(d);
        check_fsck(&img.path, how).unwrap();
    }
    let lib = commitfs::Fs::open_path(
        &img.path,
        commitfs::MountOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    for how in [
        "SIGTERM to the pid file's process",
        "SIGTERM to the worker",
        "umount",
    ] {
        let ino = lib.resolve(&format!("/{how}")).unwrap();
        assert_eq!(lib.getattr(ino).unwrap().size, how.len() as u64, "{how}");
    }
}

#[test]
fn monitor_cleans_up_after_a_killed_worker() {
    let img = mkfs("sbx-kill", 32, &[]);
    let d = Daemon::mount(&img.path);
    let monitor = d.pid();
    let worker = the_worker(monitor);
    assert_sandboxed(worker, 65534);
    fs::write(d.dir.path.join("f"), b"x").unwrap();
    let sock = commitfs::cmd::stats::socket_path(&d.dir.path);
    assert!(sock.exists(), "no stats socket at {}", sock.display());
    // SAFETY: killing a process this test started.
    assert_eq!(unsafe { libc::kill(worker as i32, libc::SIGKILL) }, 0);
    assert!(wait_gone(worker, 20), "worker survived SIGKILL");
    assert!(wait_gone(monitor, 20), "monitor {monitor} still running");
    // No dead mount ("transport endpoint is not connected") is left behind,
    // nor the stats socket the worker served (the monitor removes it).
    assert!(!is_mounted(&d.dir.path, "fuse"), "dead mount left");
    assert!(fs::read_dir(&d.dir.path).unwrap().next().is_none());
    assert!(!sock.exists(), "stats socket {} left", sock.display());
}
