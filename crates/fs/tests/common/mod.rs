//! Helpers shared by the integration tests of this crate: directory-tree snapshots
//! (through the library and through a host mount), kernel mounts over loop devices,
//! e2fsck and image geometry. Included with `mod common;`; not every test uses every
//! item.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use commitfs_format::group_desc::GroupDesc;
use commitfs_format::superblock::Superblock;
use commitfs_fs::testutil::{fsck, problem_lines, TempImage};
use commitfs_fs::{FileType, Fs, ROOT_INO};

// -------------------------------------------------------------------------------------
// Trees
// -------------------------------------------------------------------------------------

/// kind, permission bits, links, size, content (file data or symlink target).
pub type Entry = (String, u32, u32, u64, Vec<u8>);
pub type Tree = BTreeMap<String, Entry>;

pub fn lib_tree(fs: &Fs) -> Tree {
    let mut out = BTreeMap::new();
    let mut stack = vec![(ROOT_INO, String::new())];
    while let Some((dir, path)) = stack.pop() {
        for e in fs.readdir_all(dir).unwrap() {
            if e.name == b"." || e.name == b".." || e.name == b"lost+found" {
                continue;
            }
            let p = format!("{path}/{}", String::from_utf8_lossy(&e.name));
            let a = fs.getattr(e.ino).unwrap();
            let content = match a.kind {
                FileType::Regular => {
                    let mut b = vec![0u8; a.size as usize];
                    fs.read(e.ino, 0, &mut b).unwrap();
                    b
                }
                FileType::Symlink => fs.readlink(e.ino).unwrap(),
                _ => Vec::new(),
            };
            let dir = a.kind == FileType::Directory;
            let size = if dir { 0 } else { a.size };
            let entry = (
                format!("{:?}", a.kind),
                a.perm as u32,
                a.nlink,
                size,
                content,
            );
            out.insert(p.clone(), entry);
            if dir {
                stack.push((e.ino, p));
            }
        }
    }
    out
}

pub fn host_tree(root: &Path) -> Tree {
    let mut out = BTreeMap::new();
    let mut stack = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, path)) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            if name == "lost+found" {
                continue;
            }
            let p = format!("{path}/{name}");
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            let (kind, content) = if m.is_dir() {
                ("Directory", Vec::new())
            } else if m.file_type().is_symlink() {
                let t = std::fs::read_link(e.path()).unwrap();
                ("Symlink", t.into_os_string().into_encoded_bytes())
            } else {
                ("Regular", std::fs::read(e.path()).unwrap())
            };
            let size = if m.is_dir() { 0 } else { m.len() };
            let perm = m.permissions().mode() & 0o7777;
            out.insert(
                p.clone(),
                (kind.to_string(), perm, m.nlink() as u32, size, content),
            );
            if m.is_dir() {
                stack.push((e.path(), p));
            }
        }
    }
    out
}

/// Readable difference of two trees (paths and what differs, not the data).
pub fn tree_diff(a: &Tree, b: &Tree) -> String {
    let mut s = String::new();
    for (p, x) in a {
        match b.get(p) {
            None => s += &format!("only in first: {p}\n"),
            Some(y) if y != x => {
                s += &format!(
                    "{p}: {:?} perm {:o} links {} size {} vs {:?} perm {:o} links {} size {}{}\n",
                    x.0,
                    x.1,
                    x.2,
                    x.3,
                    y.0,
                    y.1,
                    y.2,
                    y.3,
                    if x.4 != y.4 { " (content differs)" } else { "" }
                )
            }
            _ => {}
        }
    }
    for p in b.keys().filter(|p| !a.contains_key(*p)) {
        s += &format!("only in second: {p}\n");
    }
    s
}

// -------------------------------------------------------------------------------------
// The kernel (loop device + mount, both undone on drop, also when a test fails)
// -------------------------------------------------------------------------------------

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// A loop device over an image file, detached on drop.
pub struct LoopDev {
    pub dev: String,
}

impl LoopDev {
    pub fn new(img: &Path) -> LoopDev {
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(img)
            .output()
            .expect("run losetup");
        assert!(
            out.status.success(),
            "losetup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        LoopDev {
            dev: String::from_utf8_lossy(&out.stdout).trim().to_string(),
        }
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        for _ in 0..100 {
            let ok = Command::new("losetup")
                .arg("-d")
                .arg(&self.dev)
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // Detaching is asynchronous: wait until the device no longer names a file,
        // so that e2fsck does not take the image for a mounted one.
        for _ in 0..200 {
            let out = Command::new("losetup").arg(&self.dev).output();
            match out {
                Ok(o) if o.status.success() && !o.stdout.is_empty() => {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                _ => break,
            }
        }
    }
}

/// A kernel ext4 mount of a loop device; unmounted (retrying a busy umount, then
/// lazily) and its directory removed on drop, before the loop device is detached.
pub struct KernelMount {
    pub dir: PathBuf,
    mounted: bool,
    // Dropped after `Drop::drop` ran: the umount comes first.
    lo: LoopDev,
}

impl KernelMount {
    /// Mount `img` (through a fresh loop device) with the mount options `opts`.
    pub fn try_new(img: &Path, opts: &str) -> std::result::Result<KernelMount, String> {
        let lo = LoopDev::new(img);
        let dir = img.with_extension("mnt");
        std::fs::create_dir_all(&dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "ext4", "-o", opts])
            .arg(&lo.dev)
            .arg(&dir)
            .output()
            .unwrap();
        let m = KernelMount {
            dir,
            mounted: out.status.success(),
            lo,
        };
        if !m.mounted {
            let dmesg = Command::new("dmesg")
                .output()
                .map(|o| {
                    let t = String::from_utf8_lossy(&o.stdout).into_owned();
                    let lines: Vec<&str> = t.lines().collect();
                    lines[lines.len().saturating_sub(6)..].join("\n")
                })
                .unwrap_or_default();
            return Err(format!(
                "{}\n{dmesg}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(m)
    }
    pub fn new(img: &Path, opts: &str) -> KernelMount {
        Self::try_new(img, opts).unwrap_or_else(|e| panic!("kernel mount failed: {e}"))
    }
    /// Fast commits the kernel made on this mount (`/proc/fs/ext4/<dev>/fc_info`).
    pub fn fc_commits(&self) -> u64 {
        let name = self.lo.dev.rsplit('/').next().unwrap_or_default();
        let p = format!("/proc/fs/ext4/{name}/fc_info");
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_suffix(" commits"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for KernelMount {
    fn drop(&mut self) {
        if self.mounted {
            let mut ok = false;
            for _ in 0..40 {
                if Command::new("umount")
                    .arg(&self.dir)
                    .status()
                    .is_ok_and(|s| s.success())
                {
                    ok = true;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            if !ok {
                let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

// -------------------------------------------------------------------------------------
// Images and e2fsck
// -------------------------------------------------------------------------------------

pub fn copy_image(src: &Path, tag: &str) -> TempImage {
    let dst = src.with_extension(format!("{tag}.img"));
    std::fs::copy(src, &dst).unwrap();
    TempImage { path: dst }
}

pub fn assert_clean(path: &Path, who: &str) {
    let r = fsck(path);
    assert!(
        r.is_clean(),
        "{who}: e2fsck -fn reported problems (exit {}): {:?}\n{}",
        r.code,
        problem_lines(&r.output),
        r.output
    );
}

pub fn e2fsck_fy(path: &Path) -> String {
    let out = Command::new("e2fsck")
        .arg("-fy")
        .arg(path)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let code = out.status.code().unwrap_or(-1);
    assert!(
        code == 0 || code == 1,
        "e2fsck -fy failed ({code}):\n{text}"
    );
    text
}

/// Superblock, descriptors, block size and inode size of an image file.
pub struct Geometry {
    pub sb: Superblock,
    pub gds: Vec<GroupDesc>,
    pub bs: usize,
    pub isz: usize,
}

pub fn geometry(img: &[u8]) -> Geometry {
    let sb = Superblock::parse(&img[1024..2048]).unwrap();
    let bs = sb.block_size();
    let ds = sb.desc_size();
    let gdt = (sb.first_data_block() as usize + 1) * bs;
    let gds = (0..sb.group_count())
        .map(|g| {
            let o = gdt + g as usize * ds;
            GroupDesc::parse(&img[o..o + ds], g, 0).unwrap()
        })
        .collect();
    let isz = sb.inode_size() as usize;
    Geometry { sb, gds, bs, isz }
}

pub fn inode_offset(g: &Geometry, ino: u32) -> usize {
    let ipg = g.sb.inodes_per_group();
    let grp = ((ino - 1) / ipg) as usize;
    let idx = ((ino - 1) % ipg) as usize;
    g.gds[grp].inode_table as usize * g.bs + idx * g.isz
}

pub fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i as u32 / 7) % 251) as u8 + 1)
        .collect()
}

// -------------------------------------------------------------------------------------
// A slow device
// -------------------------------------------------------------------------------------

use commitfs_device::{BlockDevice, IoCategory, IoStats, RecordingDevice, Result as DevResult};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::thread::ThreadId;
use std::time::Duration;

/// A recording device with latency: each cache flush and each FUA write takes
/// `latency` (slept after the request is applied, as a device acknowledges it
/// late). Remembers which threads wrote fast-commit blocks.
pub struct SlowDevice {
    pub inner: RecordingDevice,
    pub latency: Duration,
    pub fc_writers: Mutex<HashSet<ThreadId>>,
    pub flushes: AtomicU64,
}

impl BlockDevice for SlowDevice {
    fn read_at(&self, offset: u64, buf: &mut [u8], cat: IoCategory) -> DevResult<()> {
        self.inner.read_at(offset, buf, cat)
    }
    fn write_at(&self, offset: u64, buf: &[u8], cat: IoCategory, fua: bool) -> DevResult<()> {
        self.inner.write_at(offset, buf, cat, fua)?;
        if cat == IoCategory::FastCommit {
            self.fc_writers
                .lock()
                .unwrap()
                .insert(std::thread::current().id());
        }
        if fua {
            std::thread::sleep(self.latency);
        }
        Ok(())
    }
    fn flush(&self) -> DevResult<()> {
        self.inner.flush()?;
        self.flushes.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(self.latency);
        Ok(())
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

impl SlowDevice {
    pub fn new(image: Vec<u8>, latency: Duration) -> SlowDevice {
        SlowDevice {
            inner: RecordingDevice::new(image),
            latency,
            fc_writers: Mutex::new(HashSet::new()),
            flushes: AtomicU64::new(0),
        }
    }
}

// -------------------------------------------------------------------------------------
// Durability of concurrent fsyncs
// -------------------------------------------------------------------------------------

/// One fsync that returned: thread `t` fsynced its file `/t{t}/f{i}` (created with
/// `content(t, i)`) when the device had logged `ops` requests.
#[derive(Debug, Clone, Copy)]
pub struct FsyncDone {
    pub t: u32,
    pub i: u32,
    pub ops: usize,
}

/// Power cuts right after sampled fsync returns (`samples` of them, plus the
/// first and the end): recover the image of what was durable and check that every
/// file fsynced by then is there with its data; finally `e2fsck -fn` the end
/// image. `img`: the test's image file (its name is reused for a scratch copy).
pub fn check_fsyncs_durable(
    dev: &RecordingDevice,
    mut done: Vec<FsyncDone>,
    content: impl Fn(u32, u32) -> Vec<u8>,
    samples: usize,
    img: &Path,
    what: &str,
) {
    use commitfs_device::{CrashSpec, MemDevice};
    use commitfs_fs::MountOptions;
    use std::sync::Arc;
    let check = |k: usize, must: &[&FsyncDone], label: &str| -> Vec<u8> {
        let image = dev.crash_log().image(&CrashSpec {
            k,
            seed: 0,
            keep_256: 0,
            torn: false,
        });
        let mem = Arc::new(MemDevice::from_vec(image));
        let fs = Fs::open(mem.clone(), MountOptions::default())
            .unwrap_or_else(|e| panic!("{what} {label}: recovery failed: {e}"));
        for d in must {
            let path = format!("/t{}/f{}", d.t, d.i);
            let ino = fs.resolve(&path).unwrap_or_else(|e| {
                panic!("{what} {label}: {path} was fsynced but is missing: {e}")
            });
            let want = content(d.t, d.i);
            assert_eq!(
                fs.getattr(ino).unwrap().size,
                want.len() as u64,
                "{what} {label}: size of {path}"
            );
            let mut buf = vec![0u8; want.len()];
            fs.read(ino, 0, &mut buf).unwrap();
            assert!(buf == want, "{what} {label}: data of {path}");
        }
        fs.unmount().unwrap();
        drop(fs);
        Arc::try_unwrap(mem)
            .ok()
            .expect("the file system let go of the device")
            .into_vec()
    };
    done.sort_by_key(|d| d.ops);
    let n = done.len();
    let mut picks: Vec<usize> = (1..=samples).map(|j| j * n / samples - 1).collect();
    picks.insert(0, 0);
    picks.dedup();
    for &j in &picks {
        let k = done[j].ops;
        let must: Vec<&FsyncDone> = done.iter().filter(|d| d.ops <= k).collect();
        check(k, &must, &format!("after fsync {} of {n}", j + 1));
    }
    let all: Vec<&FsyncDone> = done.iter().collect();
    let end = check(dev.op_count(), &all, "at the end");
    let scratch = img.with_extension("recovered.img");
    std::fs::write(&scratch, &end).unwrap();
    let r = fsck(&scratch);
    let _ = std::fs::remove_file(&scratch);
    assert!(
        r.is_clean(),
        "{what}: e2fsck -fn after recovery: {:?}\n{}",
        problem_lines(&r.output),
        r.output
    );
}
