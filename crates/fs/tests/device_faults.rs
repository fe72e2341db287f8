//! Device faults (issue #9 item 9): an I/O error on a journal or metadata write
//! makes the file system behave as `errors=` says, never continues as if the
//! write had happened, and never loses data an fsync acknowledged; an I/O error
//! on data reaches the writer or the next fsync of that file.
//!
//! Every test runs on a real `mkfs.ext4` image held in memory behind a
//! [`FaultyDevice`]; afterwards the device content is mounted again (replaying the
//! journal) and judged by `e2fsck -fn`.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use commitfs_device::{BlockDevice, DeviceRef, Fault, FaultyDevice, IoCategory, MemDevice};
use commitfs_format::superblock::{self as sbf, Superblock};
use commitfs_fs::testutil::{mkfs, TempImage};
use commitfs_fs::*;

mod common;
use common::*;

/// A mounted image on a fault-injecting device.
struct Rig {
    mem: Arc<MemDevice>,
    dev: Arc<FaultyDevice>,
    fs: Fs,
    img: TempImage,
}

fn opts(errors: Option<ErrorsBehavior>) -> MountOptions {
    MountOptions {
        // No background commits: the tests decide when the journal writes.
        commit_interval: 0,
        errors,
        ..Default::default()
    }
}

fn rig(tag: &str, extra: &[&str], errors: Option<ErrorsBehavior>) -> Rig {
    rig_with(tag, extra, opts(errors))
}

fn rig_with(tag: &str, extra: &[&str], o: MountOptions) -> Rig {
    let img = mkfs(tag, 32, extra);
    let mem = Arc::new(MemDevice::from_file(&img.path).unwrap());
    let dev = Arc::new(FaultyDevice::new(mem.clone()));
    let fs = Fs::open(dev.clone() as DeviceRef, o).unwrap();
    Rig { mem, dev, fs, img }
}

impl Rig {
    /// Stop using the file system (drop = unmount, which must write nothing after
    /// a fatal error), store the device content in the image file, and mount it
    /// again on a healthy device: journal recovery runs like after a crash.
    fn remount(self) -> (Fs, TempImage) {
        let Rig { mem, dev, fs, img } = self;
        drop(fs);
        drop(dev);
        std::fs::write(&img.path, mem.contents()).unwrap();
        let fs = Fs::open_path(&img.path, opts(None)).unwrap();
        (fs, img)
    }

    fn writes(&self) -> u64 {
        let s = self.mem.stats().snapshot();
        s.total_writes() + s.flushes
    }
}

fn home_superblock(path: &Path) -> Superblock {
    let img = std::fs::read(path).unwrap();
    Superblock::parse(&img[1024..2048]).unwrap()
}

fn read_all(fs: &Fs, ino: Ino) -> Vec<u8> {
    let size = fs.getattr(ino).unwrap().size as usize;
    let mut buf = vec![0u8; size];
    let n = fs.read(ino, 0, &mut buf).unwrap();
    buf.truncate(n);
    buf
}

fn is_io(e: &FsError) -> bool {
    matches!(
        e,
        FsError::Journal(_) | FsError::Device(_) | FsError::DataWriteFailed | FsError::Shutdown
    ) && !e.is_corruption()
}

/// Create `name` in the root with `data` and fsync it.
fn durable_file(fs: &Fs, name: &str, data: &[u8]) -> Ino {
    let f = fs.create(ROOT_INO, name.as_bytes(), 0o644, 0, 0).unwrap();
    fs.write(f.ino, 0, data).unwrap();
    fs.fsync(f.ino, false).unwrap();
    f.ino
}

/// The image after recovery: e2fsck -fn clean and unmounted cleanly.
fn check_image(fs: Fs, img: &TempImage, who: &str) {
    fs.unmount().unwrap();
    drop(fs);
    assert_clean(&img.path, who);
}

/// A failed journal write (errors=remount-ro): the fsync reports EIO, the file
/// system refuses every change from then on while reads keep working, no later
/// operation reports success for state that was never written, unmount writes
/// nothing, and after recovery everything fsynced before is there and nothing
/// after; the superblock records the error so e2fsck checks fully next time.
fn journal_failure_remount_ro(extra: &[&str], cat: IoCategory) {
    let r = rig("jfail", extra, Some(ErrorsBehavior::RemountRo));
    let fs = &r.fs;
    let a_data = pattern(1, 20_000);
    let a = durable_file(fs, "a", &a_data);
    r.dev.inject(Fault::writes().category(cat));
    let b = fs.create(ROOT_INO, b"b", 0o644, 0, 0).unwrap();
    fs.write(b.ino, 0, &pattern(2, 5000)).unwrap();
    let e = fs.fsync(b.ino, false).unwrap_err();
    assert!(is_io(&e), "fsync after a failed journal write: {e:?}");
    assert!(r.dev.injected() >= 1);
    assert!(fs.is_read_only());
    let after_error = r.writes();
    // Nothing claims success any more.
    for res in [
        fs.create(ROOT_INO, b"c", 0o644, 0, 0).map(|_| ()),
        fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).map(|_| ()),
        fs.write(a, 0, b"xyz").map(|_| ()),
        fs.unlink(ROOT_INO, b"a"),
        fs.setattr(
            a,
            &SetAttr {
                size: Some(1),
                ..Default::default()
            },
        )
        .map(|_| ()),
    ] {
        assert!(matches!(res, Err(FsError::ReadOnly)), "{res:?}");
    }
    // fsync and sync never acknowledge again, even with the device healed.
    r.dev.heal();
    assert!(is_io(&fs.fsync(a, false).unwrap_err()));
    assert!(is_io(&fs.fsync(b.ino, false).unwrap_err()));
    assert!(fs.sync().is_err());
    assert!(
        fs.is_read_only(),
        "a healed device does not resurrect the journal"
    );
    // Reads keep working.
    assert_eq!(read_all(fs, a), a_data);
    assert_eq!(fs.lookup(ROOT_INO, b"b").unwrap().ino, b.ino);
    fs.unmount().unwrap();
    assert_eq!(r.writes(), after_error, "nothing written after the error");
    let (fs2, img) = r.remount();
    let sb = fs2.superblock();
    assert_ne!(sb.state() & sbf::STATE_ERROR_FS, 0, "error state recorded");
    assert!(sb.error_count() >= 1);
    let a2 = fs2.resolve("/a").unwrap();
    assert_eq!(read_all(&fs2, a2), a_data, "fsynced data intact");
    assert!(
        matches!(fs2.resolve("/b"), Err(FsError::NotFound)),
        "an fsync that failed must not have committed anything"
    );
    check_image(fs2, &img, "after a journal write failure");
    let sb = home_superblock(&img.path);
    assert_ne!(
        sb.state() & sbf::STATE_ERROR_FS,
        0,
        "e2fsck must still be told to check"
    );
}

#[test]
fn journal_write_failure_remount_ro() {
    journal_failure_remount_ro(&[], IoCategory::Journal);
}

#[test]
fn fast_commit_write_failure_remount_ro() {
    journal_failure_remount_ro(&["-O", "fast_commit"], IoCategory::FastCommit);
}

/// A failed checkpoint (home metadata write): the journal aborts, the log tail
/// stays, and recovery replays every fsynced change.
#[test]
fn checkpoint_write_failure_keeps_the_log() {
    let r = rig("cpfail", &[], Some(ErrorsBehavior::RemountRo));
    let fs = &r.fs;
    let mut files = Vec::new();
    for i in 0..20u32 {
        let data = pattern(10 + i, 3000 + i as usize * 100);
        durable_file(fs, &format!("f{i}"), &data);
        files.push(data);
    }
    // Home metadata writes beyond the superblock fail: the checkpoint of the
    // unmount cannot write the committed blocks home.
    r.dev.inject(
        Fault::writes()
            .category(IoCategory::Metadata)
            .bytes(4096..u64::MAX),
    );
    let e = fs.unmount().unwrap_err();
    assert!(is_io(&e), "{e:?}");
    assert!(fs.is_read_only());
    assert!(is_io(&fs.sync().unwrap_err()));
    r.dev.heal();
    let (fs2, img) = r.remount();
    assert_ne!(fs2.superblock().state() & sbf::STATE_ERROR_FS, 0);
    for (i, data) in files.iter().enumerate() {
        let ino = fs2.resolve(&format!("/f{i}")).unwrap();
        assert_eq!(&read_all(&fs2, ino), data, "f{i}");
    }
    check_image(fs2, &img, "after a failed checkpoint");
}

/// A failed cache flush: the fsync fails, and no later fsync claims the data
/// that sat in the cache is durable (the 2018 PostgreSQL fsync lesson).
#[test]
fn flush_failure_is_never_acknowledged_later() {
    let r = rig("flushfail", &[], Some(ErrorsBehavior::RemountRo));
    let fs = &r.fs;
    let a_data = pattern(3, 9000);
    let a = durable_file(fs, "a", &a_data);
    fs.write(a, 0, &pattern(4, 9000)).unwrap();
    r.dev.inject(Fault::flushes().once());
    assert!(is_io(&fs.fsync(a, false).unwrap_err()));
    // The device works again, but the cache content is unknown.
    assert_eq!(r.dev.injected(), 1);
    for _ in 0..3 {
        assert!(is_io(&fs.fsync(a, false).unwrap_err()));
    }
    assert!(fs.is_read_only());
    let (fs2, img) = r.remount();
    let a2 = fs2.resolve("/a").unwrap();
    assert_eq!(fs2.getattr(a2).unwrap().size, 9000);
    check_image(fs2, &img, "after a failed flush");
}

/// A failed data write: the writer gets the error, the next fsync of that file
/// reports EIO once, the file never maps a block holding stale bytes, and the
/// file system stays read-write (data errors are not file-system errors, as in
/// ext4).
#[test]
fn data_write_failure_reaches_writer_and_next_fsync_once() {
    // The write-through path (`-o nocache`): the writer itself hits the device.
    let r = rig_with(
        "datafail",
        &[],
        MountOptions {
            page_cache: false,
            ..opts(Some(ErrorsBehavior::RemountRo))
        },
    );
    let fs = &r.fs;
    let keep = pattern(5, 4096);
    let a = durable_file(fs, "a", &keep);
    let before = fs.getattr(a).unwrap();
    r.dev
        .inject(Fault::writes().category(IoCategory::Data).once());
    let e = fs.write(a, 4096, &pattern(6, 8192)).unwrap_err();
    assert!(is_io(&e), "the writer sees the error: {e:?}");
    let after = fs.getattr(a).unwrap();
    assert_eq!(
        after.size, before.size,
        "a failed append does not grow the file"
    );
    assert_eq!(
        after.blocks, before.blocks,
        "the blocks allocated for the failed write are not kept"
    );
    assert!(matches!(
        fs.fsync(a, false).unwrap_err(),
        FsError::DataWriteFailed
    ));
    // Reported once; the file system carries on.
    fs.fsync(a, false).unwrap();
    assert!(!fs.is_read_only());
    let other = durable_file(fs, "other", b"fine");
    assert_eq!(read_all(fs, other), b"fine");
    // A short write: the first chunk (an overwrite of the mapped block 0) lands,
    // the second (a fresh block 1) fails: the writer gets the count written.
    let b = fs.create(ROOT_INO, b"b", 0o644, 0, 0).unwrap();
    fs.write(b.ino, 0, &pattern(7, 4096)).unwrap();
    fs.fsync(b.ino, false).unwrap();
    let blocks_before = fs.getattr(b.ino).unwrap().blocks;
    r.dev
        .inject(Fault::writes().category(IoCategory::Data).after(1).once());
    let new = pattern(8, 8192);
    assert_eq!(fs.write(b.ino, 0, &new).unwrap(), 4096, "short write");
    assert!(matches!(
        fs.fsync(b.ino, false).unwrap_err(),
        FsError::DataWriteFailed
    ));
    let ba = fs.getattr(b.ino).unwrap();
    assert_eq!((ba.size, ba.blocks), (4096, blocks_before));
    let (fs2, img) = r.remount();
    let a2 = fs2.resolve("/a").unwrap();
    assert_eq!(read_all(&fs2, a2), keep);
    let b2 = fs2.resolve("/b").unwrap();
    assert_eq!(read_all(&fs2, b2), &new[..4096]);
    assert_eq!(
        fs2.superblock().state() & sbf::STATE_ERROR_FS,
        0,
        "a data error is not a file-system error"
    );
    check_image(fs2, &img, "after a failed data write");
}

/// Remount a populated image with a cold cache and fail one metadata read.
fn cold_read_failure(errors: ErrorsBehavior) -> (Rig, Result<Ino>) {
    let r = rig("readfail", &[], Some(errors));
    let d = r.fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap();
    for i in 0..200u32 {
        r.fs.create(d.ino, format!("f{i}").as_bytes(), 0o644, 0, 0)
            .unwrap();
    }
    r.fs.unmount().unwrap();
    let Rig { mem, dev, fs, img } = r;
    drop(fs);
    let fs = Fs::open(dev.clone() as DeviceRef, opts(Some(errors))).unwrap();
    let r = Rig { mem, dev, fs, img };
    r.dev
        .inject(Fault::reads().category(IoCategory::Metadata).once());
    let res = r.fs.resolve("/d/f150");
    (r, res)
}

/// errors=continue: a metadata read error is recorded (superblock written
/// home at once) and the file system stays in use.
#[test]
fn errors_continue_records_and_carries_on() {
    let (r, res) = cold_read_failure(ErrorsBehavior::Continue);
    assert!(is_io(&res.unwrap_err()));
    // Reported under the file-system lock: the record is written by the next
    // request, outside it.
    r.fs.statfs().unwrap();
    let home = Superblock::parse(&r.mem.contents()[1024..2048]).unwrap();
    assert_ne!(home.state() & sbf::STATE_ERROR_FS, 0, "error state on disk");
    assert_eq!(home.error_count(), 1);
    assert_eq!(home.last_error_func(), "read_meta");
    let fs = &r.fs;
    assert!(!fs.is_read_only());
    assert!(fs.resolve("/d/f150").is_ok(), "the read works again");
    let data = pattern(9, 7000);
    let f = durable_file(fs, "after", &data);
    assert_eq!(read_all(fs, f), data);
    // A journal write failure still aborts the journal in continue mode.
    r.dev
        .inject(Fault::writes().category(IoCategory::Journal).once());
    fs.create(ROOT_INO, b"lost", 0o644, 0, 0).unwrap();
    assert!(is_io(&fs.sync().unwrap_err()));
    assert!(matches!(
        fs.create(ROOT_INO, b"x", 0o644, 0, 0),
        Err(FsError::ReadOnly)
    ));
    assert!(fs.fsync(f, false).is_err());
    let (fs2, img) = r.remount();
    assert_eq!(read_all(&fs2, fs2.resolve("/after").unwrap()), data);
    assert!(fs2.resolve("/lost").is_err());
    assert!(fs2.superblock().error_count() >= 2);
    check_image(fs2, &img, "errors=continue");
}

/// errors=remount-ro: the same metadata read error turns the file system
/// read-only; reads keep working.
#[test]
fn errors_remount_ro_on_metadata_read_error() {
    let (r, res) = cold_read_failure(ErrorsBehavior::RemountRo);
    assert!(is_io(&res.unwrap_err()));
    let fs = &r.fs;
    assert!(fs.is_read_only());
    assert!(matches!(
        fs.create(ROOT_INO, b"x", 0o644, 0, 0),
        Err(FsError::ReadOnly)
    ));
    assert!(fs.resolve("/d/f150").is_ok());
    assert!(fs.sync().is_err());
    let (fs2, img) = r.remount();
    assert_eq!(fs2.superblock().last_error_func(), "read_meta");
    check_image(fs2, &img, "errors=remount-ro");
}

/// errors=panic: the file system stops at once (every request fails, the
/// shutdown hook runs) and writes nothing more; recovery brings back all that
/// was fsynced.
#[test]
fn errors_panic_stops_and_writes_nothing_more() {
    let r = rig("panic", &[], Some(ErrorsBehavior::Panic));
    let fired = Arc::new(AtomicBool::new(false));
    let f2 = fired.clone();
    r.fs.on_shutdown(move || f2.store(true, Ordering::SeqCst));
    let fs = &r.fs;
    let data = pattern(11, 12345);
    let a = durable_file(fs, "a", &data);
    fs.create(ROOT_INO, b"pending", 0o644, 0, 0).unwrap();
    r.dev
        .inject(Fault::writes().category(IoCategory::Journal).once());
    assert!(is_io(&fs.fsync(a, false).unwrap_err()));
    assert!(fired.load(Ordering::SeqCst), "shutdown hook");
    assert!(fs.has_shut_down());
    let after_error = r.writes();
    let mut buf = [0u8; 10];
    assert!(matches!(fs.getattr(a), Err(FsError::Shutdown)));
    assert!(matches!(fs.read(a, 0, &mut buf), Err(FsError::Shutdown)));
    assert!(matches!(
        fs.create(ROOT_INO, b"x", 0o644, 0, 0),
        Err(FsError::Shutdown)
    ));
    assert!(matches!(
        fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0),
        Err(FsError::Shutdown)
    ));
    assert!(fs.fsync(a, false).is_err());
    fs.unmount().unwrap();
    assert_eq!(r.writes(), after_error, "nothing written after the panic");
    let (fs2, img) = r.remount();
    assert_eq!(read_all(&fs2, fs2.resolve("/a").unwrap()), data);
    assert!(fs2.resolve("/pending").is_err());
    assert_ne!(fs2.superblock().state() & sbf::STATE_ERROR_FS, 0);
    check_image(fs2, &img, "errors=panic");
}

/// Without `errors=`, the superblock's `s_errors` decides, like the kernel
/// (mke2fs writes continue; tune2fs -e changes it).
#[test]
fn errors_default_comes_from_the_superblock() {
    let img = mkfs("errdefault", 16, &[]);
    let fs = Fs::open_path(&img.path, opts(None)).unwrap();
    assert_eq!(fs.errors_behavior(), ErrorsBehavior::Continue);
    drop(fs);
    for (flag, want) in [
        ("remount-ro", ErrorsBehavior::RemountRo),
        ("panic", ErrorsBehavior::Panic),
    ] {
        let out = std::process::Command::new("tune2fs")
            .args(["-e", flag])
            .arg(&img.path)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let fs = Fs::open_path(&img.path, opts(None)).unwrap();
        assert_eq!(fs.errors_behavior(), want);
        drop(fs);
        let fs = Fs::open_path(&img.path, opts(Some(ErrorsBehavior::Continue))).unwrap();
        assert_eq!(
            fs.errors_behavior(),
            ErrorsBehavior::Continue,
            "the option wins"
        );
    }
}

/// The kernel replays the log of a journal aborted by commitfs: an image left
/// by a failed journal write mounts in ext4 with the fsynced file, and e2fsck
/// is clean after.
#[test]
fn kernel_recovers_an_aborted_journal() {
    if !is_root() {
        eprintln!("skipped: needs root for a loop mount");
        return;
    }
    let r = rig("jkernel", &[], Some(ErrorsBehavior::RemountRo));
    let data = pattern(12, 50_000);
    durable_file(&r.fs, "a", &data);
    r.dev.inject(Fault::writes().category(IoCategory::Journal));
    r.fs.create(ROOT_INO, b"b", 0o644, 0, 0).unwrap();
    assert!(r.fs.sync().is_err());
    let Rig { mem, dev, fs, img } = r;
    drop(fs);
    drop(dev);
    std::fs::write(&img.path, mem.contents()).unwrap();
    {
        let m = KernelMount::new(&img.path, "rw");
        assert_eq!(std::fs::read(m.dir.join("a")).unwrap(), data);
        assert!(!m.dir.join("b").exists());
    }
    assert_clean(&img.path, "after kernel recovery");
}

/// Without a journal (write-home commits) a failed home write aborts the same
/// way: the sync fails, changes are refused, and what was synced before stays.
#[test]
fn write_home_failure_without_journal() {
    let r = rig(
        "nojournal",
        &["-O", "^has_journal"],
        Some(ErrorsBehavior::RemountRo),
    );
    let fs = &r.fs;
    let data = pattern(13, 6000);
    let a = durable_file(fs, "a", &data);
    fs.create(ROOT_INO, b"b", 0o644, 0, 0).unwrap();
    r.dev.inject(
        Fault::writes()
            .category(IoCategory::Metadata)
            .bytes(4096..u64::MAX),
    );
    assert!(is_io(&fs.sync().unwrap_err()));
    assert!(fs.is_read_only());
    assert!(matches!(
        fs.create(ROOT_INO, b"c", 0o644, 0, 0),
        Err(FsError::ReadOnly)
    ));
    assert!(fs.fsync(a, false).is_err());
    let (fs2, _img) = r.remount();
    assert_eq!(read_all(&fs2, fs2.resolve("/a").unwrap()), data);
    assert_ne!(fs2.superblock().state() & sbf::STATE_ERROR_FS, 0);
}

/// With the page cache the writer never meets the device: a data write fails
/// at write-back (here, the fsync's). Its blocks are mapped by a transaction
/// that must not commit without them, so the journal aborts (ext4's
/// `data_err=abort`): that fsync and every later one report EIO — none ever
/// claims the lost data (the lesson of PostgreSQL's fsync in 2018) — and after
/// recovery the file holds what the last successful fsync made durable.
#[test]
fn cached_write_back_failure_is_reported_by_every_later_fsync() {
    for mode in [ErrorsBehavior::Continue, ErrorsBehavior::RemountRo] {
        let r = rig("wbfail", &[], Some(mode));
        let fs = &r.fs;
        let keep = pattern(5, 4096);
        let a = durable_file(fs, "a", &keep);
        let b = durable_file(fs, "b", &keep);
        r.dev
            .inject(Fault::writes().category(IoCategory::Data).once());
        assert_eq!(
            fs.write(a, 4096, &pattern(6, 8192)).unwrap(),
            8192,
            "{mode:?}: the write lands in the cache"
        );
        assert_eq!(fs.getattr(a).unwrap().size, 4096 + 8192);
        assert_eq!(r.dev.injected(), 0, "nothing reached the device yet");
        let e = fs.fsync(a, false).unwrap_err();
        assert!(is_io(&e), "{mode:?}: the fsync sees the error: {e:?}");
        assert_eq!(r.dev.injected(), 1);
        for k in 0..3 {
            let e = fs.fsync(a, false).unwrap_err();
            assert!(is_io(&e), "{mode:?}: later fsync {k}: {e:?}");
        }
        // Other files too: nothing can be made durable any more.
        fs.write(b, 0, b"more").unwrap_or(0);
        assert!(
            fs.fsync(b, false).is_err(),
            "{mode:?}: fsync of another file"
        );
        let (fs2, img) = r.remount();
        let a2 = fs2.resolve("/a").unwrap();
        assert_eq!(
            read_all(&fs2, a2),
            keep,
            "{mode:?}: the durable data, nothing else"
        );
        check_image(fs2, &img, "after a failed write-back");
    }
}

/// A read error while warming what a changing operation will read (warm.rs:
/// blocks read outside the file-system lock, predicted) is not that
/// operation's error: a last close whose first predicted extent-tree block
/// fails to read still frees the file (the read is made again under the
/// lock, and succeeds), records no error and leaves the file system
/// writable. Failing the close instead left the file's blocks allocated,
/// its open count held, until unmount.
#[test]
fn failed_predicted_read_does_not_fail_a_last_close() {
    let img = mkfs("warm-fault", 64, &["-b", "4096"]);
    let bs = 4096u64;
    let nfrag = 700u64;
    {
        let fs = Fs::open_path(&img.path, opts(None)).unwrap();
        let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
        // Every other block: one extent each, so the tree has leaf blocks.
        for k in 0..nfrag {
            fs.write(f, 2 * k * bs, &[1; 4096]).unwrap();
        }
        fs.unmount().unwrap();
    }
    let mem = Arc::new(MemDevice::from_file(&img.path).unwrap());
    let dev = Arc::new(FaultyDevice::new(mem.clone()));
    let fs = Fs::open(
        dev.clone() as DeviceRef,
        opts(Some(ErrorsBehavior::RemountRo)),
    )
    .unwrap();
    let free0 = fs.statfs().unwrap().blocks_free;
    let f = fs.lookup(ROOT_INO, b"f").unwrap().ino;
    fs.open_inode(f).unwrap();
    fs.unlink(ROOT_INO, b"f").unwrap();
    dev.inject(Fault::reads().category(IoCategory::Metadata).once());
    fs.release(f).unwrap();
    assert_eq!(dev.injected(), 1, "the predicted read did not fail");
    assert!(!fs.is_read_only(), "a predicted read's error was recorded");
    fs.create(ROOT_INO, b"after", 0o644, 0, 0).unwrap();
    fs.unmount().unwrap();
    drop(fs);
    drop(dev);
    std::fs::write(&img.path, mem.contents()).unwrap();
    let fs = Fs::open_path(&img.path, opts(None)).unwrap();
    let free1 = fs.statfs().unwrap().blocks_free;
    assert!(
        free1 >= free0 + nfrag,
        "the file's blocks were not freed: {free0} -> {free1}"
    );
    fs.unmount().unwrap();
    let r = commitfs_fs::testutil::fsck(&img.path);
    assert!(r.is_clean(), "{}", r.output);
}

/// A readdirplus batch whose later entry's inode cannot be read hands out
/// the entries before it (the next call meets the error), as it did when
/// the batch's inodes were read under the file-system lock; reading them
/// outside it first must not fail the whole batch.
#[test]
fn readdir_plus_hands_out_the_entries_before_an_unreadable_inode() {
    let img = mkfs("rdp-fault", 32, &["-b", "4096"]);
    let d;
    let order: Vec<(Vec<u8>, u32)>;
    {
        let fs = Fs::open_path(&img.path, opts(None)).unwrap();
        d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
        for i in 0..60 {
            let a = fs
                .create(d, format!("file-{i}").as_bytes(), 0o644, 0, 0)
                .unwrap();
            fs.release(a.ino).unwrap();
        }
        order = fs
            .readdir_all(d)
            .unwrap()
            .into_iter()
            .map(|e| (e.name, e.ino))
            .collect();
        fs.unmount().unwrap();
    }
    let bytes = std::fs::read(&img.path).unwrap();
    let g = geometry(&bytes);
    let block = |ino: u32| (inode_offset(&g, ino) / g.bs) as u64;
    // The first entry (past the third) whose inode-table block none before
    // it shares: failing that block leaves the ones before readable.
    let k = (3..order.len())
        .find(|&k| order[..k].iter().all(|e| block(e.1) != block(order[k].1)))
        .expect("every entry shares an inode-table block with an earlier one");
    let bad = block(order[k].1) * g.bs as u64;
    let mem = Arc::new(MemDevice::from_file(&img.path).unwrap());
    let dev = Arc::new(FaultyDevice::new(mem.clone()));
    let fs = Fs::open(
        dev.clone() as DeviceRef,
        opts(Some(ErrorsBehavior::Continue)),
    )
    .unwrap();
    dev.inject(
        Fault::reads()
            .category(IoCategory::Metadata)
            .bytes(bad..bad + g.bs as u64),
    );
    let mut got = Vec::new();
    fs.readdir_plus(d, 0, |e, a| {
        assert_eq!(e.ino, a.ino);
        got.push((e.name.clone(), e.ino));
        true
    })
    .expect("the entries before the unreadable inode");
    assert!(dev.injected() > 0, "the inode-table block was never read");
    assert_eq!(got, order[..k].to_vec(), "entries handed out");
    // Continuing at the unreadable one reports the error.
    let next = fs.readdir_plus(d, order_offset(&fs, d, k), |_, _| true);
    assert!(next.is_err(), "{next:?}");
    dev.heal();
    drop(fs);
}

/// The readdir offset of entry `k` of `dir` (its predecessor's `next`).
fn order_offset(fs: &Fs, dir: Ino, k: usize) -> u64 {
    let all = fs.readdir_all(dir).unwrap();
    all[k - 1].next_offset
}
