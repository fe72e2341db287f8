//! Concurrent core, step 1 (issue #10, docs/ARCHITECTURE.md "Implemented:
//! concurrent core, step 1"): file data I/O runs outside the file-system lock,
//! under per-inode locks.
//!
//! Parallelism is shown by counts, not timing: a device whose data requests wait
//! at a gate until N threads are inside the device at once. With data I/O under
//! one file-system lock only one thread can ever be inside, the gate times out,
//! and the test fails. The stress tests run 16 threads of writes (partial blocks
//! included, on shared files in neighbouring byte ranges, so read-modify-writes
//! of one block race), reads, truncates, punches, renames over files and fsyncs
//! in every journal mode, then check the tree against a model after a remount and
//! the image with `e2fsck -fn`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use commitfs_device::{
    BlockDevice, DeviceRef, FileDevice, IoCategory, IoStats, Result as DevResult,
};
use commitfs_fs::testutil::{fsck, mkfs, problem_lines, Hold, HoldOn, TempImage};
use commitfs_fs::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How long a gated request waits for the others before the gate gives up.
const GATE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Default)]
struct GateState {
    armed: bool,
    want: usize,
    inside: usize,
    max_inside: usize,
    timed_out: bool,
}

/// A device whose data reads or writes, while armed, wait until `want` of them
/// are inside the device at once (or the gate times out and disarms).
struct GateDevice {
    inner: DeviceRef,
    gate_writes: bool,
    st: Mutex<GateState>,
    cv: Condvar,
}

impl GateDevice {
    fn new(inner: DeviceRef, gate_writes: bool) -> GateDevice {
        GateDevice {
            inner,
            gate_writes,
            st: Mutex::new(GateState::default()),
            cv: Condvar::new(),
        }
    }

    fn arm(&self, want: usize) {
        let mut st = self.st.lock().unwrap();
        *st = GateState {
            armed: true,
            want,
            ..Default::default()
        };
    }

    /// (most requests inside at once, whether the gate timed out)
    fn result(&self) -> (usize, bool) {
        let st = self.st.lock().unwrap();
        (st.max_inside, st.timed_out)
    }

    fn pass(&self) {
        let mut st = self.st.lock().unwrap();
        if !st.armed {
            return;
        }
        st.inside += 1;
        st.max_inside = st.max_inside.max(st.inside);
        if st.max_inside >= st.want {
            self.cv.notify_all();
        }
        let deadline = Instant::now() + GATE_TIMEOUT;
        while st.armed && st.max_inside < st.want {
            let now = Instant::now();
            if now >= deadline {
                st.timed_out = true;
                st.armed = false;
                self.cv.notify_all();
                break;
            }
            st = self.cv.wait_timeout(st, deadline - now).unwrap().0;
        }
        st.inside -= 1;
    }
}

impl BlockDevice for GateDevice {
    fn read_at(&self, offset: u64, buf: &mut [u8], cat: IoCategory) -> DevResult<()> {
        if cat == IoCategory::Data && !self.gate_writes {
            self.pass();
        }
        self.inner.read_at(offset, buf, cat)
    }
    fn write_at(&self, offset: u64, buf: &[u8], cat: IoCategory, fua: bool) -> DevResult<()> {
        if cat == IoCategory::Data && self.gate_writes {
            self.pass();
        }
        self.inner.write_at(offset, buf, cat, fua)
    }
    fn write_sectors(&self, offset: u64, buf: &[u8], cat: IoCategory) -> DevResult<()> {
        self.inner.write_sectors(offset, buf, cat)
    }
    fn flush(&self) -> DevResult<()> {
        self.inner.flush()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn stats(&self) -> &IoStats {
        self.inner.stats()
    }
}

/// A device whose data requests take `delay` (slept before the request, as a
/// device would take its time): makes data I/O of concurrent threads overlap, so
/// a missing lock shows (two read-modify-writes of one block lose an update).
struct SlowData {
    inner: DeviceRef,
    delay: Duration,
}

impl BlockDevice for SlowData {
    fn read_at(&self, offset: u64, buf: &mut [u8], cat: IoCategory) -> DevResult<()> {
        if cat == IoCategory::Data {
            std::thread::sleep(self.delay);
        }
        self.inner.read_at(offset, buf, cat)
    }
    fn write_at(&self, offset: u64, buf: &[u8], cat: IoCategory, fua: bool) -> DevResult<()> {
        if cat == IoCategory::Data {
            std::thread::sleep(self.delay);
        }
        self.inner.write_at(offset, buf, cat, fua)
    }
    fn write_sectors(&self, offset: u64, buf: &[u8], cat: IoCategory) -> DevResult<()> {
        self.inner.write_sectors(offset, buf, cat)
    }
    fn flush(&self) -> DevResult<()> {
        self.inner.flush()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn stats(&self) -> &IoStats {
        self.inner.stats()
    }
}

fn opts() -> MountOptions {
    MountOptions {
        commit_interval: 0,
        ..Default::default()
    }
}

/// The write-through path: data reaches the device at `write()` and reads
/// always go to it (`-o nocache`).
fn nocache_opts() -> MountOptions {
    MountOptions {
        page_cache: false,
        ..opts()
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8 | 1)
        .collect()
}

fn assert_clean(path: &std::path::Path, what: &str) {
    let r = fsck(path);
    assert!(
        r.is_clean(),
        "{what}: e2fsck -fn: {:?}\n{}",
        problem_lines(&r.output),
        r.output
    );
}

const GATE_THREADS: usize = 8;

/// One file per gated thread, `w{t}`, with 8 KiB of `pattern(t)`.
fn gated_files(fs: &Fs) -> Vec<Ino> {
    files_of_pattern(fs, "w", GATE_THREADS, 8192)
}

/// `n` files `{prefix}{t}` in the root, each holding `len` bytes of `pattern(t)`.
fn files_of_pattern(fs: &Fs, prefix: &str, n: usize, len: usize) -> Vec<Ino> {
    (0..n)
        .map(|t| {
            let a = fs
                .create(ROOT_INO, format!("{prefix}{t}").as_bytes(), 0o644, 0, 0)
                .unwrap();
            fs.write(a.ino, 0, &pattern(t as u64, len)).unwrap();
            a.ino
        })
        .collect()
}

/// The gated files after thread `t` wrote `pattern(100 + t)` over bytes
/// 500..3500 and appended `pattern(101 + t)` (3,000 bytes).
fn check_gated_files(fs: &Fs, files: &[Ino]) {
    for (t, &ino) in files.iter().enumerate() {
        let mut want = pattern(t as u64, 8192);
        want[500..3500].copy_from_slice(&pattern(100 + t as u64, 3000));
        want.extend_from_slice(&pattern(101 + t as u64, 3000));
        let mut buf = vec![0u8; want.len() + 10];
        let n = fs.read(ino, 0, &mut buf).unwrap();
        assert_eq!(n, want.len(), "size of w{t}");
        assert!(buf[..n] == want[..], "content of w{t}");
    }
}

/// Data writes of different files are inside the device at once: 8 threads,
/// each a partial-block overwrite of its own file (read-modify-write) and an
/// append to it.
#[test]
fn data_writes_run_in_parallel() {
    let img = mkfs("cc-gate-w", 64, &["-b", "4096"]);
    let dev = Arc::new(GateDevice::new(
        Arc::new(FileDevice::open(&img.path, false).unwrap()),
        true,
    ));
    let fs = Fs::open(dev.clone(), nocache_opts()).unwrap();
    let files = gated_files(&fs);
    fs.sync().unwrap();

    for round in 0..2u64 {
        dev.arm(GATE_THREADS);
        std::thread::scope(|s| {
            for (t, &ino) in files.iter().enumerate() {
                let fs = &fs;
                s.spawn(move || {
                    let data = pattern(100 + t as u64 + round, 3000);
                    if round == 0 {
                        // In place, in the middle of block 0: read-modify-write.
                        fs.write(ino, 500, &data).unwrap();
                    } else {
                        // An append: fresh blocks allocated under the lock,
                        // written outside it.
                        fs.write(ino, 8192, &data).unwrap();
                    }
                });
            }
        });
        let (max, timed_out) = dev.result();
        assert!(
            !timed_out && max >= GATE_THREADS,
            "round {round}: at most {max} data writes were in the device at once \
             (want {GATE_THREADS}): data I/O is serialised"
        );
    }
    // What was written is there.
    check_gated_files(&fs, &files);
    fs.unmount().unwrap();
    drop(fs);
    assert_clean(&img.path, "after the gated writes");
}

/// With the page cache, the write-backs of different files are inside the
/// device at once: each fsync writes its own file back first, and a
/// write-back's data I/O runs outside `Inner` (its blocks were mapped under
/// it, in a handle that keeps the transaction from committing first).
#[test]
fn cached_write_backs_run_in_parallel() {
    let img = mkfs("cc-gate-wb", 64, &["-b", "4096"]);
    let dev = Arc::new(GateDevice::new(
        Arc::new(FileDevice::open(&img.path, false).unwrap()),
        true,
    ));
    let fs = Fs::open(dev.clone(), opts()).unwrap();
    assert!(
        fs.cache_stats().is_some(),
        "the page cache is on by default"
    );
    let files = gated_files(&fs);
    fs.sync().unwrap();
    dev.arm(GATE_THREADS);
    std::thread::scope(|s| {
        for (t, &ino) in files.iter().enumerate() {
            let fs = &fs;
            s.spawn(move || {
                // A partial block in the middle (cached after the sync) and an
                // append: both only reach the device in the fsync.
                fs.write(ino, 500, &pattern(100 + t as u64, 3000)).unwrap();
                fs.write(ino, 8192, &pattern(101 + t as u64, 3000)).unwrap();
                fs.fsync(ino, false).unwrap();
            });
        }
    });
    let (max, timed_out) = dev.result();
    assert!(
        !timed_out && max >= GATE_THREADS,
        "at most {max} write-backs were in the device at once (want {GATE_THREADS})"
    );
    check_gated_files(&fs, &files);
    fs.unmount().unwrap();
    drop(fs);
    assert_clean(&img.path, "after the gated write-backs");
}

/// Data reads are inside the device at once: readers of one file share its
/// lock, readers of different files do not contend at all.
#[test]
fn data_reads_run_in_parallel() {
    let img = mkfs("cc-gate-r", 64, &["-b", "1024"]);
    let dev = Arc::new(GateDevice::new(
        Arc::new(FileDevice::open(&img.path, false).unwrap()),
        false,
    ));
    let fs = Fs::open(dev.clone(), nocache_opts()).unwrap();
    let shared = fs.create(ROOT_INO, b"shared", 0o644, 0, 0).unwrap().ino;
    fs.write(shared, 0, &pattern(7, 10_000)).unwrap();
    let own = files_of_pattern(&fs, "r", GATE_THREADS / 2, 5000);
    fs.sync().unwrap();
    dev.arm(GATE_THREADS);
    std::thread::scope(|s| {
        for t in 0..GATE_THREADS {
            let (fs, own) = (&fs, &own);
            s.spawn(move || {
                let (ino, seed, len) = if t % 2 == 0 {
                    (shared, 7, 10_000)
                } else {
                    (own[t / 2], (t / 2) as u64, 5000)
                };
                let mut buf = vec![0u8; len];
                // Unaligned: the partial blocks are read whole and cut.
                let n = fs.read(ino, 3, &mut buf).unwrap();
                assert_eq!(n, len - 3);
                assert!(buf[..n] == pattern(seed, len)[3..], "reader {t}");
            });
        }
    });
    let (max, timed_out) = dev.result();
    assert!(
        !timed_out && max >= GATE_THREADS,
        "at most {max} data reads were in the device at once (want {GATE_THREADS})"
    );
    fs.unmount().unwrap();
}

/// An image with `/d/x` and a file `/f` holding `data`, mounted again over a
/// device that can hold the file system's lock across a metadata read (the
/// read of d's directory block, missing from the cache after the remount).
fn image_with_gated_dir(tag: &str, data: &[u8]) -> (TempImage, Arc<Hold>, Fs, Ino) {
    let img = mkfs(tag, 64, &["-b", "4096"]);
    {
        let fs = Fs::open_path(&img.path, opts()).unwrap();
        let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
        fs.create(d, b"x", 0o644, 0, 0).unwrap();
        let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
        fs.write(f, 0, data).unwrap();
        fs.unmount().unwrap();
    }
    let dev = Arc::new(Hold::new(
        Arc::new(FileDevice::open(&img.path, false).unwrap()),
        HoldOn::MetadataRead,
    ));
    let fs = Fs::open(dev.clone(), opts()).unwrap();
    let f = fs.resolve("/f").unwrap();
    (img, dev, fs, f)
}

/// Run `op` on another thread while a third one holds the file-system lock
/// (`Fs::with_fs_lock_held`; once it held it across the gated directory-block
/// read of `image_with_gated_dir`, but that read now happens outside it):
/// what `op` returned within [`GATE_TIMEOUT`] (`None`: it did not return
/// while the lock was held). Checks that the lock was held, and still held
/// when `op` ended.
fn while_fs_lock_held<T: Send>(fs: &Fs, _dev: &Hold, op: impl FnOnce() -> T + Send) -> Option<T> {
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let holder = s.spawn(move || {
            fs.with_fs_lock_held(|| {
                held_tx.send(()).unwrap();
                let _ = release_rx.recv_timeout(2 * GATE_TIMEOUT);
            })
        });
        held_rx
            .recv_timeout(GATE_TIMEOUT)
            .expect("the file-system lock was never taken");
        let (tx, rx) = std::sync::mpsc::channel();
        s.spawn(move || {
            let _ = tx.send(op());
        });
        let got = rx.recv_timeout(GATE_TIMEOUT).ok();
        let still_held = !holder.is_finished();
        release_tx.send(()).unwrap();
        holder.join().unwrap().unwrap();
        if got.is_some() {
            assert!(still_held, "the lock was released early");
        }
        got
    })
}

/// A metadata block missing from the cache is read without the file-system
/// lock (ARCHITECTURE.md C.2): while a lookup's read of an uncached directory
/// block is held in the device, another thread takes the lock and returns;
/// so do a create in that directory and a listing of it. With the read under
/// `Inner` the lock stayed taken until the device answered.
#[test]
fn uncached_metadata_is_read_outside_the_fs_lock() {
    let (_img, dev, fs, _f) = image_with_gated_dir("cc-coldread", &pattern(1, 100));
    let lock_free = || fs.with_fs_lock_held(|| ()).is_ok();
    let before = fs.stats().metadata_reads_unlocked;
    let (x, got) = dev.while_held(|| fs.resolve("/d/x"), lock_free);
    assert_eq!(got, Some(true), "a lookup held the lock across its read");
    let x = x.unwrap();
    assert!(fs.stats().metadata_reads_unlocked > before);
    assert_eq!(fs.lookup(fs.resolve("/d").unwrap(), b"x").unwrap().ino, x);
    // Evicted again by a remount: a create and a readdir in /d.
    fs.unmount().unwrap();
    drop(fs);
    let fs = Fs::open(dev.clone(), opts()).unwrap();
    let d = fs.lookup(ROOT_INO, b"d").unwrap().ino;
    let lock_free = || fs.with_fs_lock_held(|| ()).is_ok();
    let (y, got) = dev.while_held(|| fs.create(d, b"y", 0o644, 0, 0), lock_free);
    assert_eq!(got, Some(true), "a create held the lock across its read");
    let y = y.unwrap().ino;
    fs.unmount().unwrap();
    drop(fs);
    let fs = Fs::open(dev.clone(), opts()).unwrap();
    let d = fs.lookup(ROOT_INO, b"d").unwrap().ino;
    let lock_free = || fs.with_fs_lock_held(|| ()).is_ok();
    let (names, got) = dev.while_held(
        || {
            let mut v = Vec::new();
            fs.readdir(d, 0, |e| {
                v.push((e.name.clone(), e.ino));
                true
            })
            .map(|()| v)
        },
        lock_free,
    );
    assert_eq!(got, Some(true), "a readdir held the lock across its read");
    let mut names = names.unwrap();
    names.sort();
    assert_eq!(
        names,
        vec![
            (b".".to_vec(), d),
            (b"..".to_vec(), ROOT_INO),
            (b"x".to_vec(), x),
            (b"y".to_vec(), y)
        ]
    );
    fs.unmount().unwrap();
}

/// `getattr` of a cached inode is answered by the inode table without the
/// file-system lock: it returns while another thread holds that lock across a
/// metadata read (a directory block missing from the cache).
#[test]
fn cached_getattr_needs_no_fs_lock() {
    let (_img, dev, fs, f) = image_with_gated_dir("cc-getattr", &pattern(1, 5000));
    assert_eq!(fs.getattr(f).unwrap().size, 5000);
    let got = while_fs_lock_held(&fs, &dev, || fs.getattr(f).map(|a| a.size));
    assert_eq!(
        got.map(|r| r.unwrap()),
        Some(5000),
        "getattr did not return while the file-system lock was held"
    );
    fs.unmount().unwrap();
}

/// `getxattr` of a cached inode without an xattr block is answered from its
/// in-inode area without the file-system lock (the kernel's GETXATTR of
/// `security.capability` before writes): present and absent names return
/// while another thread holds that lock across a metadata read.
#[test]
fn cached_getxattr_needs_no_fs_lock() {
    let (_img, dev, fs, f) = image_with_gated_dir("cc-getxattr", &pattern(2, 100));
    fs.setxattr(f, b"user.k", b"value", XattrFlags::default())
        .unwrap();
    assert_eq!(fs.getxattr(f, b"user.k").unwrap(), b"value");
    let got = while_fs_lock_held(&fs, &dev, || {
        (
            fs.getxattr(f, b"user.k"),
            fs.getxattr(f, b"security.capability"),
        )
    });
    let (present, absent) =
        got.expect("getxattr did not return while the file-system lock was held");
    assert_eq!(present.unwrap(), b"value");
    assert!(matches!(absent, Err(FsError::NoData)), "{absent:?}");
    fs.unmount().unwrap();
}

/// A lookup in a cached directory of a cached inode is answered without the
/// file-system lock: present and absent names in the root return while
/// another thread holds that lock across the read of another directory's
/// block.
#[test]
fn cached_lookup_needs_no_fs_lock() {
    let (_img, dev, fs, f) = image_with_gated_dir("cc-lookup", &pattern(4, 100));
    assert_eq!(fs.lookup(ROOT_INO, b"f").unwrap().ino, f);
    let got = while_fs_lock_held(&fs, &dev, || {
        (fs.lookup(ROOT_INO, b"f"), fs.lookup(ROOT_INO, b"nope"))
    });
    let (present, absent) = got.expect("lookup did not return while the file-system lock was held");
    assert_eq!(present.unwrap().ino, f);
    assert!(matches!(absent, Err(FsError::NotFound)), "{absent:?}");
    fs.unmount().unwrap();
}

/// Listing a cached directory (readdir and readdirplus, whose entries' inodes
/// are cached) needs no file-system lock either, and a LOOKUP's reference
/// to a cached inode (`open_inode`) neither.
#[test]
fn cached_listings_and_references_need_no_fs_lock() {
    let (_img, dev, fs, f) = image_with_gated_dir("cc-readdir", &pattern(5, 100));
    let names = |v: &[DirEntry]| {
        let mut n: Vec<Vec<u8>> = v.iter().map(|e| e.name.clone()).collect();
        n.sort();
        n
    };
    let all0 = fs.readdir_all(ROOT_INO).unwrap();
    for e in &all0 {
        // Every entry's inode cached (getattr reads it).
        fs.getattr(e.ino).unwrap();
    }
    let want = names(&all0);
    let mut plus0 = Vec::new();
    fs.readdir_plus(ROOT_INO, 0, |e, a| {
        plus0.push((e.name.clone(), a.ino));
        true
    })
    .unwrap();
    let got = while_fs_lock_held(&fs, &dev, || {
        let all = fs.readdir_all(ROOT_INO);
        let mut plus = Vec::new();
        let r = fs.readdir_plus(ROOT_INO, 0, |e, a| {
            plus.push((e.name.clone(), a.ino));
            true
        });
        let opened = fs.open_inode(f);
        (all, r.map(|()| plus), opened)
    });
    let (all, plus, opened) =
        got.expect("a listing did not return while the file-system lock was held");
    assert_eq!(names(&all.unwrap()), want);
    assert_eq!(plus.unwrap(), plus0);
    opened.unwrap();
    // References taken by the listings and the open: released again.
    for (name, ino) in plus0.iter().chain(plus0.iter()) {
        if name != b"." && name != b".." {
            fs.release(*ino).unwrap();
        }
    }
    fs.release(f).unwrap();
    assert!(want.contains(&b"f".to_vec()) && want.contains(&b"d".to_vec()));
    fs.unmount().unwrap();
}

/// Lookups without the file-system lock during renames: while one thread
/// moves a file between two directories and back, and another keeps renaming
/// new files over a fixed name, lookups of the moving name find it with its
/// own inode or not at all (in both directories over the run), and the fixed
/// name is always found (a rename over it never shows it missing).
#[test]
fn lookups_during_renames_see_whole_renames() {
    let img = mkfs("cc-lookup-rename", 64, &["-b", "4096", "-N", "4096"]);
    let fs = Fs::open_path(&img.path, opts()).unwrap();
    let a = fs.mkdir(ROOT_INO, b"a", 0o755, 0, 0).unwrap().ino;
    let b = fs.mkdir(ROOT_INO, b"b", 0o755, 0, 0).unwrap().ino;
    let m = fs.create(a, b"m", 0o644, 0, 0).unwrap().ino;
    fs.create(ROOT_INO, b"fixed", 0o644, 0, 0).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let rounds = std::sync::atomic::AtomicU64::new(0);
    let (mut seen_a, mut seen_b, mut lookups) = (0u64, 0u64, 0u64);
    std::thread::scope(|s| {
        s.spawn(|| {
            // Every 100th position is held until the lookups have gone round
            // twice, so that both directories are seen whatever the
            // scheduler does; the others race the lookups.
            let hold = |k: u32| {
                if k.is_multiple_of(100) {
                    let r = rounds.load(Ordering::Acquire);
                    while rounds.load(Ordering::Acquire) < r + 2 {
                        std::thread::yield_now();
                    }
                }
            };
            for k in 0..1500 {
                fs.rename(a, b"m", b, b"m", RenameFlags::default()).unwrap();
                hold(k);
                fs.rename(b, b"m", a, b"m", RenameFlags::default()).unwrap();
                hold(k);
            }
            stop.store(true, Ordering::Release);
        });
        s.spawn(|| {
            let mut i = 0;
            while !stop.load(Ordering::Acquire) {
                let tmp = format!("tmp{i}");
                fs.create(ROOT_INO, tmp.as_bytes(), 0o644, 0, 0).unwrap();
                fs.rename(
                    ROOT_INO,
                    tmp.as_bytes(),
                    ROOT_INO,
                    b"fixed",
                    RenameFlags::default(),
                )
                .unwrap();
                i += 1;
            }
        });
        while !stop.load(Ordering::Acquire) {
            for (dir, seen) in [(a, &mut seen_a), (b, &mut seen_b)] {
                match fs.lookup(dir, b"m") {
                    Ok(at) => {
                        assert_eq!(at.ino, m, "m found with another inode");
                        *seen += 1;
                    }
                    Err(FsError::NotFound) => {}
                    Err(e) => panic!("lookup of m: {e}"),
                }
            }
            if let Err(e) = fs.lookup(ROOT_INO, b"fixed") {
                panic!("the fixed name was not found during a rename over it: {e}");
            }
            lookups += 1;
            rounds.fetch_add(1, Ordering::Release);
        }
    });
    assert!(
        lookups > 100 && seen_a > 0 && seen_b > 0,
        "{lookups} {seen_a} {seen_b}"
    );
    fs.unmount().unwrap();
    assert_clean(&img.path, "after renames and lookups");
}

/// statfs reads a mirror of the group descriptors' free counts instead of
/// summing them under the file-system lock: after creates, writes (cached and
/// written back), truncates, unlinks, directories made and removed, fsyncs
/// (fast commits) and syncs, from several threads, and again after a
/// remount, it equals the sum under the lock; and it returns while that lock
/// is held.
#[test]
fn statfs_mirror_matches_the_descriptors() {
    let img = mkfs(
        "cc-statfs",
        64,
        &["-b", "4096", "-N", "4096", "-O", "fast_commit"],
    );
    let mount = || {
        Fs::open_path(
            &img.path,
            MountOptions {
                fast_commit: true,
                ..opts()
            },
        )
        .unwrap()
    };
    let fs = mount();
    let same = |fs: &Fs, when: &str| {
        assert_eq!(fs.statfs().unwrap(), fs.statfs_exact().unwrap(), "{when}");
    };
    same(&fs, "after mount");
    std::thread::scope(|s| {
        for t in 0..4 {
            let fs = &fs;
            s.spawn(move || {
                let d = fs
                    .mkdir(ROOT_INO, format!("d{t}").as_bytes(), 0o755, 0, 0)
                    .unwrap()
                    .ino;
                for i in 0..60 {
                    let name = format!("f{i}");
                    let a = fs.create(d, name.as_bytes(), 0o644, 0, 0).unwrap();
                    fs.write(a.ino, 0, &pattern(i as u64, 3000 + 700 * (i % 9)))
                        .unwrap();
                    if i % 7 == 0 {
                        fs.fsync(a.ino, false).unwrap();
                    }
                    if i % 5 == 0 {
                        fs.setattr(
                            a.ino,
                            &SetAttr {
                                size: Some(100),
                                ..Default::default()
                            },
                        )
                        .unwrap();
                    }
                    if i % 3 == 0 {
                        fs.unlink(d, name.as_bytes()).unwrap();
                    }
                }
                let e = fs.mkdir(d, b"empty", 0o755, 0, 0).unwrap();
                assert!(e.ino > 0);
                fs.rmdir(d, b"empty").unwrap();
            });
        }
    });
    same(&fs, "after the threads");
    fs.sync().unwrap();
    same(&fs, "after sync");
    fs.unmount().unwrap();
    drop(fs);
    let fs = mount();
    same(&fs, "after remount");
    fs.unmount().unwrap();
    drop(fs);
    assert_clean(&img.path, "after the statfs workload");

    let (_img, dev, fs, _f) = image_with_gated_dir("cc-statfs-lock", &pattern(6, 100));
    let want = fs.statfs().unwrap();
    let got = while_fs_lock_held(&fs, &dev, || fs.statfs());
    assert_eq!(
        got.expect("statfs did not return while the file-system lock was held")
            .unwrap(),
        want
    );
    fs.unmount().unwrap();
}

/// A close counts in the inode table without the file-system lock unless it
/// is the last one of a file unlinked while open; an unlink and a close of
/// the same file racing each other must still free the inode exactly once:
/// either the unlink finds it closed and frees it, or it keeps it for the
/// close to free (the inode lock orders them; the inode table decides and
/// marks under one lock besides). 8 threads, each 250 times: create, open, then an unlink
/// and a close at once (two threads through a barrier); afterwards every
/// inode is free again and e2fsck finds nothing.
#[test]
fn racing_close_and_unlink_free_each_inode_once() {
    let img = mkfs("cc-close-unlink", 64, &["-b", "4096", "-N", "4096"]);
    let fs = Fs::open_path(&img.path, opts()).unwrap();
    let free0 = fs.statfs().unwrap().files_free;
    std::thread::scope(|s| {
        for t in 0..8 {
            let fs = &fs;
            s.spawn(move || {
                for i in 0..250 {
                    let name = format!("f{t}-{i}");
                    let a = fs.create(ROOT_INO, name.as_bytes(), 0o644, 0, 0).unwrap();
                    fs.open_inode(a.ino).unwrap();
                    let go = std::sync::Barrier::new(2);
                    std::thread::scope(|s2| {
                        s2.spawn(|| {
                            go.wait();
                            fs.release(a.ino).unwrap();
                        });
                        go.wait();
                        fs.unlink(ROOT_INO, name.as_bytes()).unwrap();
                    });
                }
            });
        }
    });
    assert_eq!(
        fs.statfs().unwrap().files_free,
        free0,
        "an inode unlinked and closed at once was not freed"
    );
    fs.unmount().unwrap();
    assert_clean(&img.path, "after racing closes and unlinks");
}

/// A read the page cache answers takes no file-system lock: it returns while
/// another thread holds that lock across a metadata read. The first read of
/// the file (after a remount: nothing cached) keeps its blocks, so the second
/// is such a read; with relatime an atime already newer than mtime asks for
/// no update either.
#[test]
fn cached_read_needs_no_fs_lock() {
    let data = pattern(3, 3 * 4096 + 100);
    let (_img, dev, fs, f) = image_with_gated_dir("cc-read", &data);
    let mut buf = vec![0u8; data.len() + 50];
    // First read: from the device, kept; it updates atime (relatime: atime
    // was not newer than mtime), so the next one is not due.
    assert_eq!(fs.read(f, 0, &mut buf).unwrap(), data.len());
    assert_eq!(&buf[..data.len()], &data[..]);
    let fills = fs.cache_stats().unwrap().read_fills;
    assert_eq!(
        fills, 4,
        "the file's 4 blocks are kept after the first read"
    );
    let got = while_fs_lock_held(&fs, &dev, || {
        let mut b = vec![0u8; 5000];
        fs.read(f, 4000, &mut b).map(|n| (n, b))
    });
    let (n, b) = got
        .expect("a cached read did not return while the file-system lock was held")
        .unwrap();
    assert_eq!((n, &b[..]), (5000, &data[4000..9000]));
    let st = fs.cache_stats().unwrap();
    assert_eq!(st.read_fills, fills, "the second read kept nothing new");
    assert!(st.read_hits >= 1);
    fs.unmount().unwrap();
}

/// A read at or past the end of a file the page cache knows takes no
/// file-system lock either (every read-to-the-end loop ends with one): the
/// cache's size is the visible one. Checked for a file read back (clean
/// pages) and for one just written (dirty pages, its on-disk size still 0).
#[test]
fn read_at_the_end_of_a_cached_file_needs_no_fs_lock() {
    let data = pattern(5, 2 * 4096 + 10);
    let (_img, dev, fs, f) = image_with_gated_dir("cc-read-eof", &data);
    let mut buf = vec![0u8; data.len()];
    assert_eq!(fs.read(f, 0, &mut buf).unwrap(), data.len());
    let w = fs.create(ROOT_INO, b"fresh", 0o644, 0, 0).unwrap().ino;
    assert_eq!(fs.write(w, 0, &data[..5000]).unwrap(), 5000);
    for (ino, size) in [(f, data.len() as u64), (w, 5000)] {
        for off in [size, size + 1, size + 10 * 4096] {
            let got = while_fs_lock_held(&fs, &dev, || {
                let mut b = vec![0u8; 4096];
                fs.read(ino, off, &mut b)
            });
            let n = got
                .unwrap_or_else(|| {
                    panic!("a read at {off} of inode {ino} (size {size}) waited for the file-system lock")
                })
                .unwrap();
            assert_eq!(
                n, 0,
                "a read at {off} of a file of {size} bytes returned data"
            );
        }
    }
    // The bytes before the end are still there, and the size is the one
    // written (the end was answered from the cache, not from the inode).
    let mut b = vec![0u8; 8192];
    assert_eq!(fs.read(w, 0, &mut b).unwrap(), 5000);
    assert_eq!(&b[..5000], &data[..5000]);
    assert_eq!(fs.getattr(w).unwrap().size, 5000);
    fs.unmount().unwrap();
}

/// A cached read whose atime update is due (relatime: atime older than mtime)
/// takes no file-system lock either: the new atime goes into the cached
/// inode, visible at once, and the next commit writes it.
#[test]
fn cached_read_with_due_atime_needs_no_fs_lock() {
    let data = pattern(4, 2 * 4096);
    let (_img, dev, fs, f) = image_with_gated_dir("cc-read-atime", &data);
    let mut buf = vec![0u8; data.len()];
    assert_eq!(fs.read(f, 0, &mut buf).unwrap(), data.len());
    // atime older than mtime: the next read must update it.
    let old = Timestamp::new(1_000_000, 0);
    fs.setattr(
        f,
        &SetAttr {
            atime: Some(SetTime::At(old)),
            mtime: Some(SetTime::At(Timestamp::new(2_000_000, 0))),
            ..Default::default()
        },
    )
    .unwrap();
    let got = while_fs_lock_held(&fs, &dev, || {
        let mut b = vec![0u8; 4096];
        fs.read(f, 0, &mut b).map(|n| (n, b))
    });
    let (n, b) = got
        .expect("a cached read with a due atime did not return while the file-system lock was held")
        .unwrap();
    assert_eq!((n, &b[..]), (4096, &data[..4096]));
    let a = fs.getattr(f).unwrap().atime;
    assert!(a > old, "the read did not update atime ({a:?})");
    fs.unmount().unwrap();
}

/// Freeing blocks does not wait for a fast commit's flush: an unlink (whose
/// freed blocks the journal checks against the log, under the file-system
/// lock) returns while another thread's fast commit is held in its flush. It
/// used to wait, because the fast commit held the log's lock across its I/O,
/// and with it every operation queued behind the file-system lock.
#[test]
fn unlink_does_not_wait_for_a_fast_commit_flush() {
    let img = mkfs("cc-fcflush", 64, &["-b", "4096", "-O", "fast_commit"]);
    let dev = Arc::new(Hold::new(
        Arc::new(FileDevice::open(&img.path, false).unwrap()),
        HoldOn::Flush,
    ));
    let o = MountOptions {
        fast_commit: true,
        ..opts()
    };
    let fs = Fs::open(dev.clone(), o).unwrap();
    let a = fs.create(ROOT_INO, b"a", 0o644, 0, 0).unwrap().ino;
    fs.write(a, 0, &pattern(1, 20_000)).unwrap();
    // A full commit: a's blocks are now in the log, waiting for a checkpoint.
    fs.sync().unwrap();
    let b = fs.create(ROOT_INO, b"b", 0o644, 0, 0).unwrap().ino;
    fs.write(b, 0, &pattern(2, 5000)).unwrap();
    let before = fs.fc_stats().commits;
    // A fast commit (b's data is unflushed: its flush comes first), held
    // in that flush while another thread unlinks.
    let (synced, got) = dev.while_held(|| fs.fsync(b, false), || fs.unlink(ROOT_INO, b"a"));
    assert!(
        matches!(got, Some(Ok(()))),
        "unlink did not return while a fast commit waited for its flush: {got:?}"
    );
    synced.unwrap();
    assert_eq!(
        fs.fc_stats().commits,
        before + 1,
        "fsync was not a fast commit"
    );
    fs.unmount().unwrap();
    drop(fs);
    drop(dev);
    assert_clean(&img.path, "after the unlink during a fast commit");
    let fs = Fs::open_path(&img.path, opts()).unwrap();
    assert!(fs.lookup(ROOT_INO, b"a").is_err());
    assert_eq!(fs.getattr(fs.resolve("/b").unwrap()).unwrap().size, 5000);
    fs.unmount().unwrap();
}

// ---------------------------------------------------------------------------------
// Stress
// ---------------------------------------------------------------------------------

const THREADS: usize = 16;
const OPS: usize = 120;
const SHARED: usize = 3;
/// Bytes of a shared file owned by one thread: not a multiple of any block size,
/// so neighbouring threads' ranges share blocks.
const REGION: u64 = 3001;

/// The model of one thread's own file.
struct Own {
    name: String,
    ino: Ino,
    data: Vec<u8>,
}

fn stress(tag: &str, mkfs_args: &[&str], o: MountOptions) {
    let img = mkfs(tag, 96, mkfs_args);
    let dev = Arc::new(SlowData {
        inner: Arc::new(FileDevice::open(&img.path, false).unwrap()),
        delay: Duration::from_micros(200),
    });
    let fs = Fs::open(dev, o.clone()).unwrap();
    let dir = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
    let shared: Vec<Ino> = (0..SHARED)
        .map(|s| {
            fs.create(dir, format!("shared{s}").as_bytes(), 0o644, 0, 0)
                .unwrap()
                .ino
        })
        .collect();
    let shared_size: Vec<AtomicU64> = (0..SHARED).map(|_| AtomicU64::new(0)).collect();
    fs.sync().unwrap();

    let results: Vec<(Vec<Own>, Vec<Vec<u8>>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (fs, shared, shared_size) = (&fs, &shared, &shared_size);
                s.spawn(move || {
                    let mut rng = StdRng::seed_from_u64(0xC0FE + t as u64);
                    let mut own: Vec<Own> = (0..2)
                        .map(|k| {
                            let name = format!("t{t}-{k}");
                            let ino = fs.create(dir, name.as_bytes(), 0o644, 0, 0).unwrap().ino;
                            Own {
                                name,
                                ino,
                                data: Vec::new(),
                            }
                        })
                        .collect();
                    // This thread's region of each shared file.
                    let mut regions = vec![vec![0u8; REGION as usize]; SHARED];
                    let base = t as u64 * REGION;
                    for op in 0..OPS {
                        let seed = (t * 100_000 + op) as u64;
                        let f = rng.gen_range(0..own.len());
                        match rng.gen_range(0..100) {
                            0..=29 => {
                                let off = rng.gen_range(0..48_000u64);
                                let len = rng.gen_range(1..9000usize);
                                let d = pattern(seed, len);
                                let o = &mut own[f];
                                assert_eq!(fs.write(o.ino, off, &d).unwrap(), len);
                                let end = off as usize + len;
                                if o.data.len() < end {
                                    o.data.resize(end, 0);
                                }
                                o.data[off as usize..end].copy_from_slice(&d);
                            }
                            30..=39 => {
                                let size = rng.gen_range(0..52_000u64);
                                let o = &mut own[f];
                                let set = SetAttr {
                                    size: Some(size),
                                    ..Default::default()
                                };
                                fs.setattr(o.ino, &set).unwrap();
                                o.data.resize(size as usize, 0);
                            }
                            40..=44 => {
                                let o = &mut own[f];
                                let off = rng.gen_range(0..50_000u64);
                                let len = rng.gen_range(1..12_000u64);
                                let flags = FallocFlags {
                                    punch_hole: true,
                                    keep_size: true,
                                    ..Default::default()
                                };
                                fs.fallocate(o.ino, off, len, flags).unwrap();
                                let size = o.data.len() as u64;
                                if off < size {
                                    let end = (off + len).min(size) as usize;
                                    o.data[off as usize..end].fill(0);
                                }
                            }
                            45..=49 => {
                                // Replace the file by a new one (rename over it:
                                // the old inode is freed).
                                let o = &mut own[f];
                                let tmp = format!("{}.tmp", o.name);
                                let n = fs.create(dir, tmp.as_bytes(), 0o644, 0, 0).unwrap().ino;
                                let d = pattern(seed, rng.gen_range(0..7000));
                                fs.write(n, 0, &d).unwrap();
                                fs.rename(
                                    dir,
                                    tmp.as_bytes(),
                                    dir,
                                    o.name.as_bytes(),
                                    RenameFlags::default(),
                                )
                                .unwrap();
                                o.ino = n;
                                o.data = d;
                            }
                            50..=69 => {
                                // Mostly near the region's ends, whose blocks the
                                // neighbouring threads write too.
                                let sf = rng.gen_range(0..SHARED);
                                let (a, b) = match rng.gen_range(0..4) {
                                    0 => {
                                        let a = rng.gen_range(0..REGION);
                                        (a, rng.gen_range(a + 1..=REGION))
                                    }
                                    1 => (0, rng.gen_range(1..200)),
                                    _ => (rng.gen_range(REGION - 200..REGION), REGION),
                                };
                                let d = pattern(seed, (b - a) as usize);
                                assert_eq!(fs.write(shared[sf], base + a, &d).unwrap(), d.len());
                                regions[sf][a as usize..b as usize].copy_from_slice(&d);
                                shared_size[sf].fetch_max(base + b, Ordering::Relaxed);
                            }
                            70..=79 => {
                                let o = &own[f];
                                let off = rng.gen_range(0..50_000u64);
                                let mut buf = vec![0u8; rng.gen_range(1..10_000)];
                                let n = fs.read(o.ino, off, &mut buf).unwrap();
                                let want = o.data.get(off as usize..).unwrap_or(&[]);
                                let want = &want[..want.len().min(buf.len())];
                                assert_eq!(n, want.len(), "thread {t} op {op}: read size");
                                assert!(buf[..n] == *want, "thread {t} op {op}: read data");
                            }
                            80..=89 => {
                                let sf = rng.gen_range(0..SHARED);
                                let mut buf = vec![0u8; REGION as usize];
                                let n = fs.read(shared[sf], base, &mut buf).unwrap();
                                let mine = regions[sf].iter().rposition(|&x| x != 0);
                                assert!(
                                    mine.is_none_or(|p| n > p),
                                    "thread {t} op {op}: shared file too short"
                                );
                                assert!(
                                    buf[..n] == regions[sf][..n],
                                    "thread {t} op {op}: region of shared{sf}"
                                );
                            }
                            _ => {
                                let ino = if rng.gen_bool(0.5) {
                                    own[f].ino
                                } else {
                                    shared[rng.gen_range(0..SHARED)]
                                };
                                fs.fsync(ino, rng.gen_bool(0.3)).unwrap();
                            }
                        }
                    }
                    (own, regions)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });

    let check = |fs: &Fs, what: &str| {
        for (own, _) in &results {
            for o in own {
                let ino = fs
                    .resolve(&format!("/d/{}", o.name))
                    .unwrap_or_else(|e| panic!("{what}: {}: {e}", o.name));
                assert_eq!(ino, o.ino, "{what}: {}", o.name);
                let mut buf = vec![0u8; o.data.len() + 100];
                let n = fs.read(ino, 0, &mut buf).unwrap();
                assert_eq!(n, o.data.len(), "{what}: size of {}", o.name);
                assert!(buf[..n] == o.data[..], "{what}: content of {}", o.name);
            }
        }
        for (sf, &ino) in shared.iter().enumerate() {
            let size = shared_size[sf].load(Ordering::Relaxed);
            assert_eq!(
                fs.getattr(ino).unwrap().size,
                size,
                "{what}: size of shared{sf}"
            );
            let mut buf = vec![0u8; size as usize];
            assert_eq!(fs.read(ino, 0, &mut buf).unwrap(), size as usize);
            for (t, (_, regions)) in results.iter().enumerate() {
                let a = (t as u64 * REGION).min(size) as usize;
                let b = ((t as u64 + 1) * REGION).min(size) as usize;
                assert!(
                    buf[a..b] == regions[sf][..b - a],
                    "{what}: region of thread {t} in shared{sf}"
                );
            }
        }
    };
    check(&fs, "before unmount");
    let st = fs.fc_stats();
    eprintln!(
        "{tag}: fast commits {}, fallbacks {:?}",
        st.commits, st.ineligible
    );
    fs.unmount().unwrap();
    drop(fs);
    assert_clean(&img.path, tag);
    let fs = Fs::open_path(&img.path, o).unwrap();
    check(&fs, "after a remount");
    fs.unmount().unwrap();
    drop(fs);
    assert_clean(&img.path, tag);
}

#[test]
fn stress_jbd2() {
    stress(
        "cc-jbd2",
        &["-b", "1024", "-O", "^fast_commit"],
        MountOptions {
            fast_commit: false,
            ..opts()
        },
    );
}

#[test]
fn stress_fast_commit() {
    stress(
        "cc-fc",
        &["-b", "4096", "-O", "fast_commit", "-J", "size=16"],
        opts(),
    );
}

#[test]
fn stress_fc_data_csum() {
    stress(
        "cc-fcdc",
        &["-b", "4096", "-O", "fast_commit", "-J", "size=16"],
        MountOptions {
            fc_data_csum: true,
            ..opts()
        },
    );
}

/// A large read streams past the cache (nothing kept); a small one keeps the
/// blocks it read.
#[test]
fn large_reads_stream_small_reads_fill() {
    let img = mkfs("cc-stream", 64, &["-b", "4096"]);
    let data = pattern(5, 1 << 20);
    {
        let fs = Fs::open_path(&img.path, opts()).unwrap();
        let f = fs.create(ROOT_INO, b"big", 0o644, 0, 0).unwrap().ino;
        fs.write(f, 0, &data).unwrap();
        fs.unmount().unwrap();
    }
    let fs = Fs::open_path(&img.path, opts()).unwrap();
    let f = fs.resolve("/big").unwrap();
    let mut buf = vec![0u8; 1 << 20];
    assert_eq!(fs.read(f, 0, &mut buf).unwrap(), 1 << 20);
    assert_eq!(buf, data);
    assert_eq!(
        fs.cache_stats().unwrap().read_fills,
        0,
        "a 1 MiB read was kept"
    );
    let mut small = vec![0u8; 6000];
    assert_eq!(fs.read(f, 10_000, &mut small).unwrap(), 6000);
    assert_eq!(&small[..], &data[10_000..16_000]);
    assert_eq!(
        fs.cache_stats().unwrap().read_fills,
        2,
        "blocks 2 and 3 kept"
    );
    fs.unmount().unwrap();
}

/// A fast commit decides an INODE record's form by comparing the inode with
/// every version replay could start from; for a changed inode-table block one
/// of them is its home copy. The journal keeps that copy once read (and
/// follows its own home writes), so a run of fast commits reads each block
/// once, not once per fsync, under the file-system lock. The files survive a
/// crash (the image as the fsyncs left it, recovered) with their data.
#[test]
fn fast_commits_read_each_inode_table_home_copy_once() {
    const FILES: u32 = 48;
    let img = mkfs(
        "cc-fchome",
        64,
        &["-b", "4096", "-I", "256", "-O", "fast_commit"],
    );
    let dev = Arc::new(FileDevice::open(&img.path, false).unwrap());
    let o = MountOptions {
        fast_commit: true,
        ..opts()
    };
    let fs = Fs::open(dev.clone(), o).unwrap();
    // A full commit first: fast commits follow one.
    fs.create(ROOT_INO, b"first", 0o644, 0, 0).unwrap();
    fs.sync().unwrap();
    let fc0 = fs.fc_stats().commits;
    let reads0 = dev.stats().snapshot().metadata.reads;
    for i in 0..FILES {
        let f = fs
            .create(ROOT_INO, format!("f{i}").as_bytes(), 0o644, 0, 0)
            .unwrap()
            .ino;
        fs.write(f, 0, &pattern(i as u64, 300)).unwrap();
        fs.fsync(f, false).unwrap();
    }
    let fcs = fs.fc_stats().commits - fc0;
    let reads = dev.stats().snapshot().metadata.reads - reads0;
    // (A full commit takes over when the fast-commit area fills.)
    assert!(fcs >= 40, "{fcs} of {FILES} fsyncs were fast commits");
    // 48 inodes of 256 bytes span 3-4 inode-table blocks (7 reads in all
    // measured); a home read per fsync made 100.
    assert!(
        reads <= 12,
        "{reads} metadata reads for {FILES} fast commits"
    );
    // The crash image: what the device holds now, recovered by a new mount.
    let crashed = TempImage {
        path: img.path.with_extension("crash.img"),
    };
    std::fs::copy(&img.path, &crashed.path).unwrap();
    drop(fs);
    let fs = Fs::open_path(&crashed.path, opts()).unwrap();
    for i in 0..FILES {
        let f = fs.resolve(&format!("/f{i}")).unwrap();
        let mut buf = vec![0u8; 300];
        assert_eq!(fs.read(f, 0, &mut buf).unwrap(), 300);
        assert_eq!(buf, pattern(i as u64, 300), "f{i}");
    }
    fs.unmount().unwrap();
    drop(fs);
    assert_clean(&crashed.path, "after recovering the fast commits");
}

/// A fast-commit image (256-byte inodes) mounted with fast commits over a
/// [`Hold`] device that can hold a metadata read.
fn fc_image_on_hold(tag: &str) -> (TempImage, Arc<Hold>, Fs) {
    let img = mkfs(tag, 64, &["-b", "4096", "-I", "256", "-O", "fast_commit"]);
    let dev = Arc::new(Hold::new(
        Arc::new(FileDevice::open(&img.path, false).unwrap()),
        HoldOn::MetadataRead,
    ));
    let o = MountOptions {
        fast_commit: true,
        ..opts()
    };
    let fs = Fs::open(dev.clone(), o).unwrap();
    (img, dev, fs)
}

/// [`fc_image_on_hold`] with /d/x made and the image mounted again, so that
/// /d's directory block is not cached: the metadata read `while_fs_lock_held`
/// holds.
fn fc_remounted_with_uncached_dir(tag: &str) -> (TempImage, Arc<Hold>, Fs) {
    let (img, dev, fs) = fc_image_on_hold(tag);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
    fs.create(d, b"x", 0o644, 0, 0).unwrap();
    fs.unmount().unwrap();
    drop(fs);
    let fs = Fs::open(
        dev.clone(),
        MountOptions {
            fast_commit: true,
            ..opts()
        },
    )
    .unwrap();
    (img, dev, fs)
}

/// `fsync(ino)` that writes exactly one fast commit.
fn fsync_by_one_fast_commit(fs: &Fs, ino: Ino, what: &str) {
    let before = fs.fc_stats().commits;
    fs.fsync(ino, false).unwrap();
    assert_eq!(
        fs.fc_stats().commits,
        before + 1,
        "{what} was not a fast commit"
    );
}

/// `fsync(ino)` on one thread, held in `dev` at its next request of the
/// device's kind, and a create of `/c` on another: the create must return
/// meanwhile (`what` names the held request), and the fsync be one fast
/// commit.
fn fsync_lets_a_create_through(fs: &Fs, dev: &Hold, ino: Ino, what: &str) {
    let before = fs.fc_stats().commits;
    let (synced, got) = dev.while_held(
        || fs.fsync(ino, false),
        || fs.create(ROOT_INO, b"c", 0o644, 0, 0).map(|a| a.ino),
    );
    assert!(
        matches!(got, Some(Ok(_))),
        "create did not return while {what}: {got:?}"
    );
    synced.unwrap();
    assert_eq!(
        fs.fc_stats().commits,
        before + 1,
        "fsync was not a fast commit"
    );
}

/// An fsync and an fdatasync of `f`, whose changes a durable fast commit
/// already carries, return while another thread holds `Inner`, and write no
/// fast commit.
fn covered_fsyncs_need_no_fs_lock(fs: &Fs, dev: &Arc<Hold>, f: Ino, what: &str) {
    let before = fs.fc_stats().commits;
    let got = while_fs_lock_held(fs, dev, || (fs.fsync(f, false), fs.fsync(f, true)));
    let (full, data) = got.unwrap_or_else(|| {
        panic!("fsyncs of {what} did not return while the file-system lock was held")
    });
    full.unwrap();
    data.unwrap();
    assert_eq!(
        fs.fc_stats().commits,
        before,
        "a covered fsync of {what} wrote a fast commit"
    );
}

/// Unmount, check the image with e2fsck, mount it again and return `path`'s
/// content (the remount is returned too, for more checks).
fn remount_and_read(img: &TempImage, fs: Fs, what: &str, path: &str, len: usize) -> (Fs, Vec<u8>) {
    fs.unmount().unwrap();
    drop(fs);
    assert_clean(&img.path, what);
    let fs = Fs::open_path(&img.path, opts()).unwrap();
    let mut buf = vec![0u8; len];
    let f = fs.resolve(path).unwrap();
    assert_eq!(fs.read(f, 0, &mut buf).unwrap(), len);
    (fs, buf)
}

/// The one home-copy read a fast commit needs per inode-table block
/// (`Journal::replay_bases`, see above) is made by the fsync before it takes
/// the file-system lock (`Journal::warm_home`): a create returns while that
/// read is held in the device. Made by the plan, under `Inner`, it queued
/// every operation behind the read.
#[test]
fn fsync_reads_home_copies_outside_the_fs_lock() {
    let (img, dev, fs) = fc_image_on_hold("cc-fcwarm");
    let b = fs.create(ROOT_INO, b"b", 0o644, 0, 0).unwrap().ino;
    fs.write(b, 0, &pattern(2, 5000)).unwrap();
    // A full commit: every block the fast commit touches is cached and
    // home, so its only metadata read is the home copy of b's block, once
    // the write-back changed it.
    fs.sync().unwrap();
    fs.write(b, 5000, &pattern(3, 100)).unwrap();
    fsync_lets_a_create_through(&fs, &dev, b, "an fsync read a home copy");
    drop(dev);
    let what = "after a create during an fsync's home read";
    let (fs, buf) = remount_and_read(&img, fs, what, "/b", 5100);
    assert_eq!(&buf[..5000], &pattern(2, 5000)[..]);
    assert_eq!(&buf[5000..], &pattern(3, 100)[..]);
    assert!(fs.lookup(ROOT_INO, b"c").is_ok());
    fs.unmount().unwrap();
}

/// `fc_data_csum`: a fast commit's DATA_CSUM records carry the CRC of the
/// file's blocks. With the page cache the fsync's own write-back wrote them
/// just before the plan's cut, and the CRCs come from those clean pages: the
/// fsync reads no data back from the device. Without it (`write` wrote them),
/// the fsync reads them after the plan, without `Inner` (ARCHITECTURE.md
/// C.2): a create returns while that read is held in the device; read by the
/// plan, under `Inner`, it queued every operation behind the read. Either way
/// the device as the fsync left it, recovered, must replay that fast commit:
/// recovery checks the CRCs against the data (a wrong one drops the commit
/// and `b`).
fn data_crcs_of_a_fast_commit(tag: &str, page_cache: bool) {
    let img = mkfs(tag, 64, &["-b", "4096", "-I", "256", "-O", "fast_commit"]);
    let dev = Arc::new(Hold::new(
        Arc::new(FileDevice::open(&img.path, false).unwrap()),
        HoldOn::DataRead,
    ));
    let o = MountOptions {
        fast_commit: true,
        fc_data_csum: true,
        page_cache,
        ..opts()
    };
    let fs = Fs::open(dev.clone(), o.clone()).unwrap();
    // Fast commits need a full commit since mount.
    fs.mkdir(ROOT_INO, b"primer", 0o755, 0, 0).unwrap();
    fs.sync().unwrap();
    let b = fs.create(ROOT_INO, b"b", 0o644, 0, 0).unwrap().ino;
    fs.write(b, 0, &pattern(2, 9000)).unwrap();
    if page_cache {
        let reads = || dev.stats().snapshot().category(IoCategory::Data).reads;
        let r0 = reads();
        fsync_by_one_fast_commit(&fs, b, "the fsync of b");
        assert_eq!(
            reads() - r0,
            0,
            "the fsync read back data it had just written"
        );
    } else {
        fsync_lets_a_create_through(&fs, &dev, b, "an fsync read data for its CRCs");
    }
    let crashed = TempImage {
        path: img.path.with_extension("crash.img"),
    };
    std::fs::copy(&img.path, &crashed.path).unwrap();
    {
        let rec = Fs::open_path(&crashed.path, o).unwrap();
        let f = rec.resolve("/b").expect("b recovered from the fast commit");
        let mut buf = vec![0u8; 9100];
        assert_eq!(rec.read(f, 0, &mut buf).unwrap(), 9000, "size of b");
        assert!(
            buf[..9000] == pattern(2, 9000)[..],
            "content of recovered b"
        );
        rec.unmount().unwrap();
    }
    assert_clean(
        &crashed.path,
        "after recovering a fast commit with data CRCs",
    );
    drop(dev);
    let what = "after a fast commit with data CRCs";
    let (fs, buf) = remount_and_read(&img, fs, what, "/b", 9000);
    assert!(buf == pattern(2, 9000), "content of /b");
    assert_eq!(fs.lookup(ROOT_INO, b"c").is_ok(), !page_cache, "/c");
    fs.unmount().unwrap();
}

#[test]
fn fast_commit_data_crcs_come_from_the_page_cache() {
    data_crcs_of_a_fast_commit("cc-fccrc", true);
}

#[test]
fn fast_commit_data_crcs_are_read_outside_the_fs_lock_without_the_cache() {
    data_crcs_of_a_fast_commit("cc-fccrc-nc", false);
}

/// The same when the file's last change (an append: fdatasync's stamp) went
/// out in a fast commit another file's fsync led: the stamp is read without
/// `Inner` and counts as none once a durable commit carries its change
/// (inner.rs `Stamp::made_durable`). It used to send such an fsync to `Inner`
/// for its entry values.
#[test]
fn fsync_of_a_change_another_fsync_covered_needs_no_fs_lock() {
    let (img, dev, fs) = fc_remounted_with_uncached_dir("cc-fcstamp");
    let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
    let g = fs.create(ROOT_INO, b"g", 0o644, 0, 0).unwrap().ino;
    fs.write(f, 0, &pattern(8, 1000)).unwrap();
    fs.sync().unwrap();
    // f grows (its stamp), then g's fsync leads the fast commit that carries it.
    fs.write(f, 1000, &pattern(8, 5000)[1000..]).unwrap();
    fs.write(g, 0, &pattern(9, 100)).unwrap();
    let data_only = fs.stats().fdatasyncs_data_only;
    fsync_by_one_fast_commit(&fs, g, "g's fsync");
    covered_fsyncs_need_no_fs_lock(&fs, &dev, f, "a change another fsync's fast commit carried");
    assert_eq!(
        fs.stats().fdatasyncs_data_only,
        data_only + 1,
        "the fdatasync of a carried append was not data-only"
    );
    drop(dev);
    let (fs, buf) = remount_and_read(&img, fs, "after g's fast commit", "/f", 5000);
    assert_eq!(buf, pattern(8, 5000));
    fs.unmount().unwrap();
}

/// An fsync (and an fdatasync) that a durable fast commit already covers
/// returns without the file-system lock: its entry values, its cover check
/// and fdatasync's stamp live under the fast-commit tracker's own locks
/// (fc.rs `FcDurable`, inner.rs `DatasyncStamps`, ARCHITECTURE.md C.1). With
/// them under `Inner`, every follower of a fast commit queued on it behind
/// whatever operation held it.
#[test]
fn covered_fsync_needs_no_fs_lock() {
    let (img, dev, fs) = fc_remounted_with_uncached_dir("cc-fccover");
    let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
    fs.write(f, 0, &pattern(7, 1000)).unwrap();
    // A full commit first: the one after the mount cannot be a fast one.
    fs.sync().unwrap();
    fs.write(f, 1000, &pattern(7, 3000)[1000..]).unwrap();
    fsync_by_one_fast_commit(&fs, f, "the fsync");
    covered_fsyncs_need_no_fs_lock(&fs, &dev, f, "a change its own fast commit carried");
    drop(dev);
    let (fs, buf) = remount_and_read(&img, fs, "after covered fsyncs", "/f", 3000);
    assert_eq!(buf, pattern(7, 3000));
    fs.unmount().unwrap();
}

/// Changing operations read no metadata (and no data) under the
/// file-system lock either (ARCHITECTURE.md C.2, warm.rs): on a freshly
/// mounted image, with and without the page cache, a create and a mkdir
/// (inode bitmap, the new inode's inode-table block, the block bitmap of a
/// directory's first block), the write-back of writes into the holes of a
/// file whose extent tree has leaves (tree blocks, block bitmap), a
/// truncate and an unlink of such files (tree blocks, the bitmaps of what
/// they free), xattr changes and a chmod (the xattr block), a link, a
/// rename of a directory (its `..`), an rmdir, the last close of an
/// unlinked file, an fallocate and the readlink of a slow symlink find what
/// they read already read without the lock. A device notes every read made
/// while the lock is held; nothing else runs meanwhile. With the warm
/// passes removed, these read under the lock.
#[test]
fn changing_operations_read_nothing_under_the_fs_lock() {
    use commitfs_fs::testutil::LockProbe;
    let img = mkfs("cc-warm", 512, &["-b", "4096"]);
    let bs = 4096u64;
    let (nfrag, target) = (700u64, vec![b'a'; 200]);
    let tags = ["c", "n"];
    {
        let fs = Fs::open_path(&img.path, nocache_opts()).unwrap();
        let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
        for t in tags {
            // Every other block: one extent each, past the inode's four, so
            // the trees have leaf blocks.
            for name in ["frag", "big", "gone", "open"] {
                let f = fs
                    .create(d, format!("{name}-{t}").as_bytes(), 0o644, 0, 0)
                    .unwrap()
                    .ino;
                for k in 0..nfrag {
                    fs.write(f, 2 * k * bs, &[k as u8 + 1; 4096]).unwrap();
                }
            }
            fs.symlink(d, format!("slow-{t}").as_bytes(), &target, 0, 0)
                .unwrap();
            for name in ["x", "y"] {
                let x = fs
                    .create(d, format!("{name}-{t}").as_bytes(), 0o644, 0, 0)
                    .unwrap()
                    .ino;
                fs.setxattr(x, b"user.big", &[7u8; 1500], XattrFlags::default())
                    .unwrap();
            }
            let mv = fs
                .mkdir(d, format!("mv-{t}").as_bytes(), 0o755, 0, 0)
                .unwrap()
                .ino;
            fs.create(mv, b"inside", 0o644, 0, 0).unwrap();
            fs.mkdir(d, format!("rmd-{t}").as_bytes(), 0o755, 0, 0)
                .unwrap();
            fs.create(d, format!("lk-{t}").as_bytes(), 0o644, 0, 0)
                .unwrap();
            let o2 = fs
                .create(d, format!("open2-{t}").as_bytes(), 0o644, 0, 0)
                .unwrap()
                .ino;
            fs.release(o2).unwrap();
        }
        fs.unmount().unwrap();
    }
    for (cached, t) in [(true, "c"), (false, "n")] {
        let dev = Arc::new(LockProbe::new(Arc::new(
            FileDevice::open(&img.path, false).unwrap(),
        )));
        let o = if cached { opts() } else { nocache_opts() };
        let fs = Fs::open(dev.clone(), o).unwrap();
        dev.watch(fs.fs_lock_probe());
        let d = fs.resolve("/d").unwrap();
        let name = |n: &str| format!("{n}-{t}").into_bytes();
        let ino = |n: &str| fs.lookup(d, &name(n)).unwrap().ino;
        let (frag, big, open, x, y, slow, lk) = (
            ino("frag"),
            ino("big"),
            ino("open"),
            ino("x"),
            ino("y"),
            ino("slow"),
            ino("lk"),
        );
        let open2 = ino("open2");
        fs.open_inode(open).unwrap();
        fs.open_inode(open2).unwrap();
        dev.take();
        // Each step: no read under the lock; with `cold`, some read at all
        // (the step did meet cold blocks).
        let step = |what: &str, cold: bool, f: &dyn Fn()| {
            let before = fs.stats().metadata_reads_unlocked;
            f();
            let (under, _) = dev.take();
            assert!(
                under.is_empty(),
                "{what} (cache {cached}) read under the fs lock: {under:?}"
            );
            assert!(
                !cold || fs.stats().metadata_reads_unlocked > before,
                "{what} (cache {cached}) read no cold metadata"
            );
        };
        step("create", true, &|| {
            fs.create(d, &name("new"), 0o644, 0, 0).unwrap();
        });
        // In the root: spread to another group (Orlov), cold there.
        step("mkdir", true, &|| {
            fs.mkdir(ROOT_INO, &name("sub"), 0o755, 0, 0).unwrap();
        });
        step("write into holes, fsync", true, &|| {
            for k in (0..nfrag).step_by(50) {
                fs.write(frag, (2 * k + 1) * bs, &[0xEE; 4096]).unwrap();
            }
            fs.fsync(frag, false).unwrap();
        });
        step("truncate", true, &|| {
            let s = SetAttr {
                size: Some(bs),
                ..Default::default()
            };
            fs.setattr(big, &s).unwrap();
        });
        step("unlink", true, &|| fs.unlink(d, &name("gone")).unwrap());
        step("setxattr", true, &|| {
            fs.setxattr(x, b"user.big", &[8u8; 1400], XattrFlags::default())
                .unwrap()
        });
        step("chmod", true, &|| {
            let s = SetAttr {
                mode: Some(0o600),
                ..Default::default()
            };
            fs.setattr(y, &s).unwrap();
        });
        step("link", false, &|| {
            fs.link(lk, ROOT_INO, &name("lk2")).unwrap();
        });
        step("rename a directory", true, &|| {
            let f = RenameFlags::default();
            fs.rename(d, &name("mv"), ROOT_INO, &name("mv"), f).unwrap()
        });
        step("rmdir", true, &|| fs.rmdir(d, &name("rmd")).unwrap());
        // Not the orphan list's head: its predecessor there changes.
        step("last close of an unlinked file", false, &|| {
            fs.unlink(d, &name("open")).unwrap();
            fs.unlink(d, &name("open2")).unwrap();
            fs.release(open).unwrap();
            fs.release(open2).unwrap();
        });
        step("fallocate", false, &|| {
            fs.fallocate(big, 8 * bs, 4 * bs, FallocFlags::default())
                .unwrap()
        });
        step("fsync", false, &|| fs.fsync(big, false).unwrap());
        step("readlink", false, &|| {
            assert_eq!(fs.readlink(slow).unwrap(), target);
        });
        fs.unmount().unwrap();
    }
    let r = fsck(&img.path);
    assert!(r.is_clean(), "{}", problem_lines(&r.output).join("\n"));
    // What the steps changed is there after a remount.
    let fs = Fs::open_path(&img.path, opts()).unwrap();
    for t in tags {
        let p = |n: &str| format!("/d/{n}-{t}");
        let frag = fs.resolve(&p("frag")).unwrap();
        let mut b = vec![0u8; 4096];
        fs.read(frag, bs, &mut b).unwrap();
        assert_eq!(b, vec![0xEE; 4096]);
        fs.read(frag, 2 * bs, &mut b).unwrap();
        assert_eq!(b, vec![2; 4096]);
        let big = fs.getattr(fs.resolve(&p("big")).unwrap()).unwrap();
        assert_eq!(
            big.size,
            12 * bs,
            "truncated to one block, then fallocated to 12"
        );
        assert!(fs.resolve(&p("gone")).is_err());
        assert!(fs.resolve(&p("open")).is_err());
        assert!(fs.resolve(&p("rmd")).is_err());
        let x = fs.resolve(&p("x")).unwrap();
        assert_eq!(fs.getxattr(x, b"user.big").unwrap(), vec![8u8; 1400]);
        let y = fs.getattr(fs.resolve(&p("y")).unwrap()).unwrap();
        assert_eq!(y.perm & 0o7777, 0o600);
        let mv = fs.resolve(&format!("/mv-{t}")).unwrap();
        assert_eq!(fs.lookup(mv, b"..").unwrap().ino, ROOT_INO);
        assert!(fs.resolve(&format!("/mv-{t}/inside")).is_ok());
        let lk = fs.resolve(&p("lk")).unwrap();
        assert_eq!(fs.resolve(&format!("/lk2-{t}")).unwrap(), lk);
    }
    fs.unmount().unwrap();
}

/// A change in a large indexed directory whose state is not cached: a
/// lookup there only probes the htree (a few blocks), but adding or
/// removing the entry loads the whole directory; the warm pass loads it
/// first, so neither a create, an unlink nor a rename into it reads the
/// directory's other blocks under the file-system lock.
#[test]
fn changes_in_an_uncached_large_directory_read_nothing_under_the_fs_lock() {
    use commitfs_fs::testutil::LockProbe;
    let img = mkfs("cc-warm-big", 128, &["-b", "4096"]);
    {
        let fs = Fs::open_path(&img.path, nocache_opts()).unwrap();
        let big = fs.mkdir(ROOT_INO, b"big", 0o755, 0, 0).unwrap().ino;
        for i in 0..3000 {
            let a = fs
                .create(
                    big,
                    format!("entry-with-a-longer-name-{i}").as_bytes(),
                    0o644,
                    0,
                    0,
                )
                .unwrap();
            fs.release(a.ino).unwrap();
        }
        fs.create(ROOT_INO, b"outside", 0o644, 0, 0).unwrap();
        fs.unmount().unwrap();
    }
    for (what, op) in [("create", 0), ("unlink", 1), ("rename into it", 2)] {
        let dev = Arc::new(LockProbe::new(Arc::new(
            FileDevice::open(&img.path, false).unwrap(),
        )));
        let fs = Fs::open(dev.clone(), opts()).unwrap();
        dev.watch(fs.fs_lock_probe());
        let big = fs.lookup(ROOT_INO, b"big").unwrap().ino;
        // A lookup of an uncached directory of this size probes its htree.
        fs.lookup(big, b"entry-with-a-longer-name-8").unwrap();
        assert!(fs.meta_cache_stats().dirs.probes > 0);
        dev.take();
        match op {
            0 => drop(fs.create(big, b"new", 0o644, 0, 0).unwrap()),
            1 => fs.unlink(big, b"entry-with-a-longer-name-7").unwrap(),
            _ => fs
                .rename(ROOT_INO, b"outside", big, b"moved", RenameFlags::default())
                .unwrap(),
        }
        let (under, _) = dev.take();
        assert!(under.is_empty(), "{what} read under the fs lock: {under:?}");
        fs.unmount().unwrap();
    }
    let fs = Fs::open_path(&img.path, opts()).unwrap();
    let big = fs.lookup(ROOT_INO, b"big").unwrap().ino;
    assert!(fs.lookup(big, b"new").is_ok());
    assert!(fs.lookup(big, b"moved").is_ok());
    assert!(fs.lookup(big, b"entry-with-a-longer-name-7").is_err());
    assert_eq!(fs.readdir_all(big).unwrap().len(), 3000 + 2 + 1);
    fs.unmount().unwrap();
    let r = fsck(&img.path);
    assert!(r.is_clean(), "{}", problem_lines(&r.output).join("\n"));
}

/// What a random workload reads under the file-system lock when the cache
/// is far too small for it (`cache_size=1` MiB: 64-256 metadata buffers)
/// and its buffers come and go between operations: nothing, but for one
/// documented case. Every changing operation's warm pass must predict what
/// it reads — a directory's leaf whose index is cached but whose buffer is
/// not, rename's walk up the new parent's ancestors, an htree split's
/// index path, the block of a listing's atime, the bitmaps of the group
/// after a full one, an evicted inode's xattr block, the superblock an
/// orphan-list change logs, the extent blocks a cached write or read maps —
/// or this fails naming the operation and the blocks. A truncate to a size
/// inside a block, a punch and a zeroed range zero their partial blocks
/// through the write path outside the lock (`Fs::zero_partial_outside`): no
/// data read under it either, except one where the zeroed bytes run past
/// the end of file inside its last block (a write cannot reach those
/// without extending the file; the operation zeroes them: test
/// `zeroing_inside_the_last_block_clears_what_lies_past_the_end_of_file`).
/// The image is checked by e2fsck after.
#[test]
fn a_random_workload_in_a_tiny_cache_reads_nothing_under_the_fs_lock() {
    use commitfs_fs::testutil::LockProbe;
    for (bs, cache, seed) in [
        (1024, true, 1),
        (4096, true, 2),
        (1024, false, 3),
        (4096, false, 4),
    ] {
        let img = mkfs("cc-tiny-cache", 64, &["-b", &bs.to_string()]);
        let dev = Arc::new(LockProbe::new(Arc::new(
            FileDevice::open(&img.path, false).unwrap(),
        )));
        let o = MountOptions {
            cache_mb: 1,
            page_cache: cache,
            ..opts()
        };
        let fs = Fs::open(dev.clone(), o).unwrap();
        fs.limit_buffer_cache(48);
        dev.watch(fs.fs_lock_probe());
        let mut rng = StdRng::seed_from_u64(seed);
        let mut dirs: Vec<u32> = vec![ROOT_INO];
        let mut files: Vec<(u32, Vec<u8>, u32)> = Vec::new();
        let mut bad = Vec::new();
        let mut metadata_reads = 0u64;
        let pick = |rng: &mut StdRng, n: usize| rng.gen_range(0..n);
        for op in 0..5000u32 {
            // Churn: attributes and listings of other files and directories
            // (read outside the lock) push this operation's blocks out.
            for _ in 0..4 {
                if let Some(f) = files.get(pick(&mut rng, files.len().max(1))) {
                    let _ = fs.lookup(f.0, &f.1);
                }
            }
            let d = dirs[pick(&mut rng, dirs.len())];
            let _ = fs.readdir_all(d);
            dev.take();
            let locked_before = fs.stats().reads_locked;
            let k = rng.gen_range(0..100);
            let name = format!("n{op}-{}", "x".repeat(rng.gen_range(0..40))).into_bytes();
            // Whether this operation zeroes bytes of the block holding the
            // end of file past it (only the operation itself can: one data
            // read under the lock allowed, see the doc comment).
            let mut past_eof = false;
            let straddles = |size: u64, a: u64, b: u64| {
                let bsz = bs as u64;
                !size.is_multiple_of(bsz)
                    && a < size.div_ceil(bsz) * bsz
                    && b > size
                    && a / bsz <= size / bsz
            };
            let what = if k < 25 || files.is_empty() {
                let d = dirs[pick(&mut rng, dirs.len())];
                if let Some(a) = full_ok(fs.create(d, &name, 0o644, 0, 0)) {
                    files.push((d, name, a.ino));
                    fs.release(a.ino).unwrap();
                }
                "create"
            } else if k < 45 {
                let ino = files[pick(&mut rng, files.len())].2;
                fs.open_inode(ino).unwrap();
                // Files of even inode numbers stay small (the small-file
                // stream's allocations), the others grow large.
                let (off, len) = if ino.is_multiple_of(2) {
                    (rng.gen_range(0..6_000), rng.gen_range(1..6_000))
                } else {
                    (rng.gen_range(0..2_000_000), rng.gen_range(1..40_000))
                };
                let data = vec![7u8; len];
                full_ok(fs.write(ino, off, &data));
                if rng.gen_bool(0.3) {
                    fs.fsync(ino, false).unwrap();
                }
                fs.release(ino).unwrap();
                "write"
            } else if k < 55 {
                let (d, nm, _) = files.swap_remove(pick(&mut rng, files.len()));
                fs.unlink(d, &nm).unwrap();
                "unlink"
            } else if k < 62 {
                let d = dirs[pick(&mut rng, dirs.len())];
                if let Some(a) = full_ok(fs.mkdir(d, &name, 0o755, 0, 0)) {
                    dirs.push(a.ino);
                }
                "mkdir"
            } else if k < 72 {
                let j = pick(&mut rng, files.len());
                let to = dirs[pick(&mut rng, dirs.len())];
                let (d, nm, ino) = files[j].clone();
                fs.rename(d, &nm, to, &name, RenameFlags::default())
                    .unwrap();
                files[j] = (to, name, ino);
                "rename"
            } else if k < 76 && dirs.len() > 2 {
                // A directory moved somewhere (refused into its own subtree).
                let a = dirs[rng.gen_range(1..dirs.len())];
                let to = dirs[pick(&mut rng, dirs.len())];
                let p = fs.lookup(a, b"..").unwrap().ino;
                let e = fs.readdir_all(p).unwrap();
                let from = e.iter().find(|e| e.ino == a).unwrap().name.clone();
                match fs.rename(p, &from, to, &name, RenameFlags::default()) {
                    Ok(()) | Err(FsError::Invalid(_)) => {}
                    Err(e) => panic!("rename of a directory: {e}"),
                }
                "rename-dir"
            } else if k < 82 {
                let ino = files[pick(&mut rng, files.len())].2;
                let new = rng.gen_range(0..1_000_000);
                let size = fs.getattr(ino).unwrap().size;
                past_eof = new < size && straddles(size, new, new.div_ceil(bs as u64) * bs as u64);
                let set = SetAttr {
                    size: Some(new),
                    ..Default::default()
                };
                fs.setattr(ino, &set).unwrap();
                "truncate"
            } else if k < 86 {
                let ino = files[pick(&mut rng, files.len())].2;
                let n = format!("user.a{}", rng.gen_range(0..5));
                let v = vec![1u8; rng.gen_range(1..600)];
                full_ok(fs.setxattr(ino, n.as_bytes(), &v, XattrFlags::default()));
                "setxattr"
            } else if k < 90 {
                let ino = files[pick(&mut rng, files.len())].2;
                let d = dirs[pick(&mut rng, dirs.len())];
                fs.link(ino, d, &name).unwrap();
                files.push((d, name, ino));
                "link"
            } else if k < 94 {
                let ino = files[pick(&mut rng, files.len())].2;
                let (off, len) = if ino.is_multiple_of(2) {
                    (rng.gen_range(0..6_000), rng.gen_range(1..6_000))
                } else {
                    (rng.gen_range(0..3_000_000), rng.gen_range(1..200_000))
                };
                // Allocate, punch a hole, or zero a range (partial edges).
                let flags = match rng.gen_range(0..3) {
                    0 => FallocFlags::default(),
                    1 => FallocFlags {
                        punch_hole: true,
                        keep_size: true,
                        ..Default::default()
                    },
                    _ => FallocFlags {
                        zero_range: true,
                        ..Default::default()
                    },
                };
                let size = fs.getattr(ino).unwrap().size;
                past_eof =
                    (flags.punch_hole || flags.zero_range) && straddles(size, off, off + len);
                full_ok(fs.fallocate(ino, off, len, flags));
                "fallocate"
            } else if k < 96 {
                fs.sync().unwrap();
                "sync"
            } else if k < 97 {
                // A symlink, slow (its target in a block) or fast, read back.
                let d = dirs[pick(&mut rng, dirs.len())];
                let target = vec![b't'; rng.gen_range(1..300)];
                if let Some(a) = full_ok(fs.symlink(d, &name, &target, 0, 0)) {
                    assert_eq!(fs.readlink(a.ino).unwrap(), target);
                }
                "symlink"
            } else if k < 98 {
                let ino = files[pick(&mut rng, files.len())].2;
                let mut b = vec![0u8; rng.gen_range(1..300_000)];
                fs.open_inode(ino).unwrap();
                fs.read(ino, rng.gen_range(0..2_000_000), &mut b).unwrap();
                fs.release(ino).unwrap();
                "read"
            } else {
                let d = dirs[pick(&mut rng, dirs.len())];
                fs.readdir_plus(d, 0, |_, _| true).unwrap();
                "readdir"
            };
            let (mut under, n) = dev.take();
            metadata_reads += n;
            // `commitfs stats` counts the same reads (`reads_locked`).
            let locked = fs.stats().reads_locked - locked_before;
            assert_eq!(locked, under.len() as u64, "op {op} {what}: reads_locked");
            if past_eof && under.len() == 1 && under[0].0 == IoCategory::Data {
                under.clear();
            }
            bad.extend(under.into_iter().map(|r| (op, what, r)));
        }
        assert!(
            bad.is_empty(),
            "block size {bs}, page cache {cache}: read under the fs lock (op, kind, (category, 4 KiB block)): {bad:?}"
        );
        // The cache really was too small: metadata came and went.
        assert!(
            metadata_reads > 2000,
            "block size {bs}: only {metadata_reads} metadata reads"
        );
        fs.unmount().unwrap();
        drop(fs);
        let r = fsck(&img.path);
        assert!(r.is_clean(), "{}", problem_lines(&r.output).join("\n"));
        eprintln!("block size {bs}, page cache {cache}: {metadata_reads} metadata reads");
    }
}

/// `r`'s value; a full file system (or xattr block) is an answer the random
/// workload may get, any other error is not.
fn full_ok<T>(r: Result<T>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(FsError::NoSpace) => None,
        Err(e) => panic!("unexpected error: {e}"),
    }
}

/// A truncate inside the last block and a zeroed range there zero the
/// block's bytes past the old end of file too (a crash can leave data
/// there: an extending write lands before its size commits). The part
/// below the end of file is zeroed through the write path outside the
/// lock (`Fs::zero_partial_outside`); the rest by the operation. An
/// extension then reads zeros, with and without the page cache.
#[test]
fn zeroing_inside_the_last_block_clears_what_lies_past_the_end_of_file() {
    for cache in [true, false] {
        for zero_range in [false, true] {
            let img = mkfs("cc-zero-eof", 16, &["-b", "4096"]);
            let o = MountOptions {
                page_cache: cache,
                ..opts()
            };
            let (ino, pblk) = {
                let fs = Fs::open_path(&img.path, o.clone()).unwrap();
                let a = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap();
                fs.write(a.ino, 0, &[b'a'; 1000]).unwrap();
                fs.fsync(a.ino, false).unwrap();
                let p = fs.mapped_blocks(a.ino).unwrap()[0];
                fs.release(a.ino).unwrap();
                fs.unmount().unwrap();
                (a.ino, p)
            };
            // What a crash can leave past the end of file.
            {
                let dev = FileDevice::open(&img.path, false).unwrap();
                dev.write_at(pblk * 4096 + 1000, &[b'X'; 3096], IoCategory::Data, false)
                    .unwrap();
                dev.flush().unwrap();
            }
            let fs = Fs::open_path(&img.path, o).unwrap();
            fs.open_inode(ino).unwrap();
            if zero_range {
                let f = FallocFlags {
                    zero_range: true,
                    ..Default::default()
                };
                fs.fallocate(ino, 500, 9000, f).unwrap();
            } else {
                let shrink = SetAttr {
                    size: Some(500),
                    ..Default::default()
                };
                fs.setattr(ino, &shrink).unwrap();
                let grow = SetAttr {
                    size: Some(9500),
                    ..Default::default()
                };
                fs.setattr(ino, &grow).unwrap();
            }
            let mut b = vec![0u8; 9500];
            assert_eq!(fs.read(ino, 0, &mut b).unwrap(), 9500);
            assert!(b[..500].iter().all(|&c| c == b'a'));
            let bad = b[500..].iter().position(|&c| c != 0).map(|k| k + 500);
            assert_eq!(
                bad, None,
                "cache {cache}, zero_range {zero_range}: stale byte"
            );
            fs.release(ino).unwrap();
            fs.unmount().unwrap();
        }
    }
}
