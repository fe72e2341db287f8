//! Differential test against the kernel (acceptance point 1).
//!
//! A seeded random sequence of file-system operations is applied, one by one, to
//! kernel ext4 (loop mount of a fresh image) and to commitfs (through the library
//! on an identical copy, or through the FUSE mount of another copy). Every
//! operation's result must agree (same value or same errno); every 250 operations
//! the trees' metadata are compared, at the end the whole trees field by field
//! (names, types, modes, owners, sizes, content hashes, link structure, symlink
//! targets, xattrs, rdev; mtime/atime either the same explicitly set value or both
//! "recent", ctime/crtime recent); both images must pass `e2fsck -fn`, and
//! commitfs's image must read back identically after a remount (library and
//! kernel, every time exact). Kernels are mounted `noatime` so atimes are
//! deterministic. Inode numbers may differ: everything is compared by path.
//!
//! The kernel side is the reference: the generator picks its next operation from
//! the kernel's current tree. Environment:
//! * `COMMITFS_DIFF_SEED` — seed (decimal or 0x hex) instead of the per-test default,
//! * `COMMITFS_DIFF_OPS` — number of operations (default 2,000),
//! * `COMMITFS_DIFF_SKIP` — comma-separated op groups not to generate (debugging:
//!   create,mknod,mkdir,rmdir,unlink,rename,link,symlink,readlink,write,read,
//!   truncate,fallocate,chmod,chown,utimens,xattr,acl,fsync,handle,stat),
//! * `COMMITFS_DIFF_KEEP_GOING=1` — do not stop at the first mismatching result,
//! * `COMMITFS_DIFF_LOG=<file>` — write every operation with both results there.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use commitfs_fs::{FallocFlags, Fs, Ino, RenameFlags, SetAttr, SetTime, Timestamp, XattrFlags};
use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const GIB4: u64 = 1 << 32;
/// Operations between two whole-tree metadata comparisons.
const CHECKPOINT_EVERY: usize = 250;
const IMAGE_MIB: u64 = 256;

// ---------------------------------------------------------------- operations

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TimeArg {
    Omit,
    Now,
    At(i64, u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NodeType {
    Fifo,
    Sock,
    Chr,
    Blk,
}

#[derive(Clone, Debug)]
enum Op {
    Create {
        path: String,
        perm: u32,
    },
    Mknod {
        path: String,
        nt: NodeType,
        perm: u32,
        major: u32,
        minor: u32,
    },
    Mkdir {
        path: String,
        perm: u32,
    },
    Rmdir {
        path: String,
    },
    Unlink {
        path: String,
    },
    /// flags: 0, RENAME_NOREPLACE (1) or RENAME_EXCHANGE (2).
    Rename {
        from: String,
        to: String,
        flags: u32,
    },
    Link {
        from: String,
        to: String,
    },
    Symlink {
        target: Vec<u8>,
        path: String,
    },
    Readlink {
        path: String,
    },
    Write {
        path: String,
        off: u64,
        len: usize,
        seed: u64,
    },
    Read {
        path: String,
        off: u64,
        len: usize,
    },
    Truncate {
        path: String,
        size: u64,
    },
    /// mode: FALLOC_FL_* bits.
    Fallocate {
        path: String,
        mode: i32,
        off: u64,
        len: u64,
    },
    Chmod {
        path: String,
        perm: u32,
    },
    Chown {
        path: String,
        uid: u32,
        gid: u32,
    },
    Utimens {
        path: String,
        atime: TimeArg,
        mtime: TimeArg,
    },
    /// flags: 0, XATTR_CREATE (1), XATTR_REPLACE (2).
    SetXattr {
        path: String,
        name: String,
        len: usize,
        seed: u64,
        flags: i32,
    },
    RemoveXattr {
        path: String,
        name: String,
    },
    GetXattr {
        path: String,
        name: String,
    },
    ListXattr {
        path: String,
    },
    /// Set `system.posix_acl_access` or `_default` to a VFS-format ACL.
    SetAcl {
        path: String,
        default: bool,
        value: Vec<u8>,
    },
    Fsync {
        path: String,
        datasync: bool,
    },
    FsyncDir {
        path: String,
    },
    Open {
        path: String,
        h: u32,
    },
    Close {
        h: u32,
    },
    ReadH {
        h: u32,
        off: u64,
        len: usize,
    },
    WriteH {
        h: u32,
        off: u64,
        len: usize,
        seed: u64,
    },
    /// Open, unlink, then read the whole (still open) file; the handle stays open.
    OpenUnlinkRead {
        path: String,
        h: u32,
        len: usize,
    },
    Stat {
        path: String,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct StatV {
    kind: Kind,
    perm: u32,
    nlink: u64,
    uid: u32,
    gid: u32,
    size: u64,
    rdev: (u32, u32),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Val {
    Unit,
    Count(usize),
    Data { len: usize, hash: u64 },
    Bytes(Vec<u8>),
    Names(Vec<Vec<u8>>),
    Stat(StatV),
}

#[derive(Clone, Debug)]
struct Fail {
    errno: i32,
    msg: String,
}

type Res = Result<Val, Fail>;

fn show(r: &Res) -> String {
    match r {
        Ok(Val::Bytes(b)) => format!(
            "Ok({} bytes, {:?})",
            b.len(),
            String::from_utf8_lossy(&b[..b.len().min(80)])
        ),
        Ok(v) => format!("Ok({v:?})"),
        Err(f) if f.msg.is_empty() => format!("Err({})", errno_name(f.errno)),
        Err(f) => format!("Err({}: {})", errno_name(f.errno), f.msg),
    }
}

fn same(a: &Res, b: &Res) -> bool {
    match (a, b) {
        (Ok(x), Ok(y)) => x == y,
        (Err(x), Err(y)) => x.errno == y.errno,
        _ => false,
    }
}

/// Deterministic data for writes and xattr values (seeded `rand`), with some
/// seeds giving mostly-zero data (so zero runs inside written blocks are covered).
fn gen_data(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let sparse = seed.is_multiple_of(5);
    let mut v = vec![0u8; len];
    for chunk in v.chunks_mut(8) {
        let w: u64 = rng.gen();
        if !sparse || w.is_multiple_of(17) {
            chunk.copy_from_slice(&w.to_le_bytes()[..chunk.len()]);
        }
    }
    v
}

fn data_val(buf: &[u8]) -> Val {
    Val::Data {
        len: buf.len(),
        hash: content_hash_of(buf),
    }
}

fn kind_bits(nt: NodeType) -> u32 {
    match nt {
        NodeType::Fifo => libc::S_IFIFO,
        NodeType::Sock => libc::S_IFSOCK,
        NodeType::Chr => libc::S_IFCHR,
        NodeType::Blk => libc::S_IFBLK,
    }
}

fn dev32(major: u32, minor: u32) -> u32 {
    (minor & 0xff) | ((major & 0xfff) << 8) | ((minor & !0xff) << 12)
}

trait Target {
    fn apply(&mut self, op: &Op) -> Res;
    /// Close every handle still open.
    fn close_all(&mut self) -> Result<(), String>;
    /// The tree as this target shows it (for checkpoints during the sequence).
    fn snapshot(&self, opts: SnapOpts) -> Snapshot;
}

// ---------------------------------------------------------------- POSIX target

/// Applies operations with system calls under a mount point (kernel or FUSE).
struct PosixTarget {
    root: PathBuf,
    handles: HashMap<u32, std::fs::File>,
}

fn errf(errno: i32) -> Fail {
    Fail {
        errno,
        msg: String::new(),
    }
}

fn io_fail(e: std::io::Error) -> Fail {
    errf(e.raw_os_error().unwrap_or(libc::EIO))
}

fn check(r: libc::c_int) -> Result<(), Fail> {
    if r < 0 {
        Err(errf(last_errno()))
    } else {
        Ok(())
    }
}

fn posix_stat(p: &Path) -> Res {
    let st = statx(p).map_err(io_fail)?;
    let mode = st.stx_mode as u32;
    let kind = Kind::from_mode(mode).ok_or_else(|| errf(libc::EIO))?;
    Ok(Val::Stat(StatV {
        kind,
        perm: mode & 0o7777,
        nlink: st.stx_nlink as u64,
        uid: st.stx_uid,
        gid: st.stx_gid,
        size: st.stx_size,
        rdev: match kind {
            Kind::Chr | Kind::Blk => (st.stx_rdev_major, st.stx_rdev_minor),
            _ => (0, 0),
        },
    }))
}

fn pread_all(f: &std::fs::File, off: u64, len: usize) -> Res {
    let mut buf = vec![0u8; len];
    let mut got = 0;
    while got < len {
        match f.read_at(&mut buf[got..], off + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => return Err(io_fail(e)),
        }
    }
    buf.truncate(got);
    Ok(data_val(&buf))
}

fn pwrite_all(f: &std::fs::File, off: u64, data: &[u8]) -> Res {
    let mut done = 0;
    while done < data.len() {
        match f.write_at(&data[done..], off + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if done == 0 => return Err(io_fail(e)),
            Err(_) => break,
        }
    }
    Ok(Val::Count(done))
}

fn timespec(t: TimeArg) -> libc::timespec {
    match t {
        TimeArg::Omit => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        TimeArg::Now => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_NOW,
        },
        TimeArg::At(s, n) => libc::timespec {
            tv_sec: s,
            tv_nsec: n as i64,
        },
    }
}

impl PosixTarget {
    fn p(&self, rel: &str) -> PathBuf {
        self.root.join(rel.trim_start_matches('/'))
    }
    fn c(&self, rel: &str) -> CString {
        cpath(&self.p(rel))
    }
    fn open_rw(&self, rel: &str) -> Result<std::fs::File, Fail> {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(self.p(rel))
            .map_err(io_fail)
    }
}

impl Target for PosixTarget {
    fn apply(&mut self, op: &Op) -> Res {
        // SAFETY (all libc calls below): paths are NUL-terminated CStrings that
        // outlive the call; buffers are valid for the lengths passed.
        unsafe {
            match op {
                Op::Create { path, perm } => {
                    let fd = libc::open(
                        self.c(path).as_ptr(),
                        libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC,
                        *perm as libc::c_uint,
                    );
                    if fd < 0 {
                        return Err(errf(last_errno()));
                    }
                    libc::close(fd);
                    Ok(Val::Unit)
                }
                Op::Mknod {
                    path,
                    nt,
                    perm,
                    major,
                    minor,
                } => {
                    let dev = libc::makedev(*major, *minor);
                    check(libc::mknod(
                        self.c(path).as_ptr(),
                        kind_bits(*nt) | perm,
                        dev,
                    ))
                    .map(|_| Val::Unit)
                }
                Op::Mkdir { path, perm } => {
                    check(libc::mkdir(self.c(path).as_ptr(), *perm)).map(|_| Val::Unit)
                }
                Op::Rmdir { path } => check(libc::rmdir(self.c(path).as_ptr())).map(|_| Val::Unit),
                Op::Unlink { path } => {
                    check(libc::unlink(self.c(path).as_ptr())).map(|_| Val::Unit)
                }
                Op::Rename { from, to, flags } => {
                    let (a, b) = (self.c(from), self.c(to));
                    let r = libc::syscall(
                        libc::SYS_renameat2,
                        libc::AT_FDCWD,
                        a.as_ptr(),
                        libc::AT_FDCWD,
                        b.as_ptr(),
                        *flags as libc::c_uint,
                    );
                    check(r as libc::c_int).map(|_| Val::Unit)
                }
                Op::Link { from, to } => {
                    check(libc::link(self.c(from).as_ptr(), self.c(to).as_ptr())).map(|_| Val::Unit)
                }
                Op::Symlink { target, path } => {
                    let t = CString::new(target.clone()).expect("no NUL in target");
                    check(libc::symlink(t.as_ptr(), self.c(path).as_ptr())).map(|_| Val::Unit)
                }
                Op::Readlink { path } => {
                    let mut buf = vec![0u8; 8192];
                    let n = libc::readlink(
                        self.c(path).as_ptr(),
                        buf.as_mut_ptr() as *mut libc::c_char,
                        buf.len(),
                    );
                    if n < 0 {
                        return Err(errf(last_errno()));
                    }
                    buf.truncate(n as usize);
                    Ok(Val::Bytes(buf))
                }
                Op::Write {
                    path,
                    off,
                    len,
                    seed,
                } => {
                    let f = self.open_rw(path)?;
                    pwrite_all(&f, *off, &gen_data(*seed, *len))
                }
                Op::Read { path, off, len } => {
                    let f = std::fs::OpenOptions::new()
                        .read(true)
                        .custom_flags(libc::O_NOFOLLOW)
                        .open(self.p(path))
                        .map_err(io_fail)?;
                    pread_all(&f, *off, *len)
                }
                Op::Truncate { path, size } => {
                    check(libc::truncate(self.c(path).as_ptr(), *size as i64)).map(|_| Val::Unit)
                }
                Op::Fallocate {
                    path,
                    mode,
                    off,
                    len,
                } => {
                    let f = self.open_rw(path)?;
                    let fd = std::os::unix::io::AsRawFd::as_raw_fd(&f);
                    check(libc::fallocate(fd, *mode, *off as i64, *len as i64)).map(|_| Val::Unit)
                }
                Op::Chmod { path, perm } => {
                    check(libc::chmod(self.c(path).as_ptr(), *perm)).map(|_| Val::Unit)
                }
                Op::Chown { path, uid, gid } => {
                    check(libc::lchown(self.c(path).as_ptr(), *uid, *gid)).map(|_| Val::Unit)
                }
                Op::Utimens { path, atime, mtime } => {
                    let ts = [timespec(*atime), timespec(*mtime)];
                    check(libc::utimensat(
                        libc::AT_FDCWD,
                        self.c(path).as_ptr(),
                        ts.as_ptr(),
                        libc::AT_SYMLINK_NOFOLLOW,
                    ))
                    .map(|_| Val::Unit)
                }
                Op::SetXattr {
                    path,
                    name,
                    len,
                    seed,
                    flags,
                } => {
                    let v = gen_data(*seed, *len);
                    let n = CString::new(name.as_str()).expect("xattr name");
                    check(libc::lsetxattr(
                        self.c(path).as_ptr(),
                        n.as_ptr(),
                        v.as_ptr() as *const libc::c_void,
                        v.len(),
                        *flags,
                    ))
                    .map(|_| Val::Unit)
                }
                Op::SetAcl {
                    path,
                    default,
                    value,
                } => {
                    let n = CString::new(acl_name(*default)).expect("acl name");
                    check(libc::lsetxattr(
                        self.c(path).as_ptr(),
                        n.as_ptr(),
                        value.as_ptr() as *const libc::c_void,
                        value.len(),
                        0,
                    ))
                    .map(|_| Val::Unit)
                }
                Op::RemoveXattr { path, name } => {
                    let n = CString::new(name.as_str()).expect("xattr name");
                    check(libc::lremovexattr(self.c(path).as_ptr(), n.as_ptr())).map(|_| Val::Unit)
                }
                Op::GetXattr { path, name } => posix_get_xattr(&self.p(path), name.as_bytes())
                    .map(Val::Bytes)
                    .map_err(errf),
                Op::ListXattr { path } => posix_list_xattrs(&self.p(path))
                    .map(|m| Val::Names(m.into_keys().collect()))
                    .map_err(errf),
                Op::Fsync { path, datasync } => {
                    let f = std::fs::File::open(self.p(path)).map_err(io_fail)?;
                    if *datasync {
                        f.sync_data().map_err(io_fail)?;
                    } else {
                        f.sync_all().map_err(io_fail)?;
                    }
                    Ok(Val::Unit)
                }
                Op::FsyncDir { path } => {
                    let f = std::fs::OpenOptions::new()
                        .read(true)
                        .custom_flags(libc::O_DIRECTORY)
                        .open(self.p(path))
                        .map_err(io_fail)?;
                    f.sync_all().map_err(io_fail)?;
                    Ok(Val::Unit)
                }
                Op::Open { path, h } => {
                    let f = self.open_rw(path)?;
                    self.handles.insert(*h, f);
                    Ok(Val::Unit)
                }
                Op::Close { h } => {
                    self.handles.remove(h).ok_or_else(|| errf(libc::EBADF))?;
                    Ok(Val::Unit)
                }
                Op::ReadH { h, off, len } => {
                    let f = self.handles.get(h).ok_or_else(|| errf(libc::EBADF))?;
                    pread_all(f, *off, *len)
                }
                Op::WriteH { h, off, len, seed } => {
                    let f = self.handles.get(h).ok_or_else(|| errf(libc::EBADF))?;
                    pwrite_all(f, *off, &gen_data(*seed, *len))
                }
                Op::OpenUnlinkRead { path, h, len } => {
                    let f = self.open_rw(path)?;
                    self.handles.insert(*h, f);
                    check(libc::unlink(self.c(path).as_ptr()))?;
                    pread_all(&self.handles[h], 0, *len)
                }
                Op::Stat { path } => posix_stat(&self.p(path)),
            }
        }
    }

    fn close_all(&mut self) -> Result<(), String> {
        self.handles.clear();
        Ok(())
    }

    fn snapshot(&self, opts: SnapOpts) -> Snapshot {
        snapshot_posix(&self.root, opts)
    }
}

// ---------------------------------------------------------------- library target

struct LibTarget {
    fs: Fs,
    handles: HashMap<u32, Ino>,
}

fn lf(e: commitfs_fs::FsError) -> Fail {
    Fail {
        errno: errno_of(&e),
        msg: e.to_string(),
    }
}

fn split(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(0) => ("/", &path[1..]),
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("/", path),
    }
}

fn ts_of(t: TimeArg) -> Option<SetTime> {
    match t {
        TimeArg::Omit => None,
        TimeArg::Now => Some(SetTime::Now),
        TimeArg::At(s, n) => Some(SetTime::At(Timestamp::new(s, n))),
    }
}

impl LibTarget {
    fn ino(&self, path: &str) -> Result<Ino, Fail> {
        self.fs.resolve(path).map_err(lf)
    }
    fn parent(&self, path: &str) -> Result<(Ino, Vec<u8>), Fail> {
        let (p, n) = split(path);
        Ok((self.ino(p)?, n.as_bytes().to_vec()))
    }
    fn read_val(&self, ino: Ino, off: u64, len: usize) -> Res {
        let mut buf = vec![0u8; len];
        let mut got = 0;
        while got < len {
            let n = self
                .fs
                .read(ino, off + got as u64, &mut buf[got..])
                .map_err(lf)?;
            if n == 0 {
                break;
            }
            got += n;
        }
        buf.truncate(got);
        Ok(data_val(&buf))
    }
    fn write_val(&self, ino: Ino, off: u64, data: &[u8]) -> Res {
        let mut done = 0;
        while done < data.len() {
            match self.fs.write(ino, off + done as u64, &data[done..]) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if done == 0 => return Err(lf(e)),
                Err(_) => break,
            }
        }
        Ok(Val::Count(done))
    }
}

impl Target for LibTarget {
    fn apply(&mut self, op: &Op) -> Res {
        let fs = &self.fs;
        match op {
            Op::Create { path, perm } => {
                let (p, n) = self.parent(path)?;
                fs.create(p, &n, *perm as u16, 0, 0)
                    .map(|_| Val::Unit)
                    .map_err(lf)
            }
            Op::Mknod {
                path,
                nt,
                perm,
                major,
                minor,
            } => {
                let (p, n) = self.parent(path)?;
                let mode = (kind_bits(*nt) | perm) as u16;
                fs.mknod(p, &n, mode, dev32(*major, *minor), 0, 0)
                    .map(|_| Val::Unit)
                    .map_err(lf)
            }
            Op::Mkdir { path, perm } => {
                let (p, n) = self.parent(path)?;
                fs.mkdir(p, &n, *perm as u16, 0, 0)
                    .map(|_| Val::Unit)
                    .map_err(lf)
            }
            Op::Rmdir { path } => {
                let (p, n) = self.parent(path)?;
                fs.rmdir(p, &n).map(|_| Val::Unit).map_err(lf)
            }
            Op::Unlink { path } => {
                let (p, n) = self.parent(path)?;
                fs.unlink(p, &n).map(|_| Val::Unit).map_err(lf)
            }
            Op::Rename { from, to, flags } => {
                let (p, n) = self.parent(from)?;
                let (q, m) = self.parent(to)?;
                let f = RenameFlags {
                    noreplace: flags & 1 != 0,
                    exchange: flags & 2 != 0,
                };
                fs.rename(p, &n, q, &m, f).map(|_| Val::Unit).map_err(lf)
            }
            Op::Link { from, to } => {
                let ino = self.ino(from)?;
                let (q, m) = self.parent(to)?;
                fs.link(ino, q, &m).map(|_| Val::Unit).map_err(lf)
            }
            Op::Symlink { target, path } => {
                let (p, n) = self.parent(path)?;
                fs.symlink(p, &n, target, 0, 0)
                    .map(|_| Val::Unit)
                    .map_err(lf)
            }
            Op::Readlink { path } => fs.readlink(self.ino(path)?).map(Val::Bytes).map_err(lf),
            Op::Write {
                path,
                off,
                len,
                seed,
            } => {
                let ino = self.ino(path)?;
                self.write_val(ino, *off, &gen_data(*seed, *len))
            }
            Op::Read { path, off, len } => {
                let ino = self.ino(path)?;
                self.read_val(ino, *off, *len)
            }
            Op::Truncate { path, size } => {
                let set = SetAttr {
                    size: Some(*size),
                    ..Default::default()
                };
                fs.setattr(self.ino(path)?, &set)
                    .map(|_| Val::Unit)
                    .map_err(lf)
            }
            Op::Fallocate {
                path,
                mode,
                off,
                len,
            } => {
                let f = FallocFlags {
                    keep_size: mode & libc::FALLOC_FL_KEEP_SIZE != 0,
                    punch_hole: mode & libc::FALLOC_FL_PUNCH_HOLE != 0,
                    zero_range: mode & libc::FALLOC_FL_ZERO_RANGE != 0,
                };
                fs.fallocate(self.ino(path)?, *off, *len, f)
                    .map(|_| Val::Unit)
                    .map_err(lf)
            }
            Op::Chmod { path, perm } => {
                let set = SetAttr {
                    mode: Some(*perm as u16),
                    ..Default::default()
                };
                fs.setattr(self.ino(path)?, &set)
                    .map(|_| Val::Unit)
                    .map_err(lf)
            }
            Op::Chown { path, uid, gid } => {
                // The VFS (not ext4) drops setuid, and setgid when group-executable,
                // on chown of a non-directory; a library caller does the same.
                let ino = self.ino(path)?;
                let a = fs.getattr(ino).map_err(lf)?;
                let mut mode = None;
                if a.kind != commitfs_fs::FileType::Directory {
                    let mut m = a.perm & !0o4000;
                    if m & 0o2010 == 0o2010 {
                        m &= !0o2000;
                    }
                    if m != a.perm {
                        mode = Some(m);
                    }
                }
                let set = SetAttr {
                    uid: Some(*uid),
                    gid: Some(*gid),
                    mode,
                    ..Default::default()
                };
                fs.setattr(ino, &set).map(|_| Val::Unit).map_err(lf)
            }
            Op::Utimens { path, atime, mtime } => {
                let set = SetAttr {
                    atime: ts_of(*atime),
                    mtime: ts_of(*mtime),
                    ..Default::default()
                };
                fs.setattr(self.ino(path)?, &set)
                    .map(|_| Val::Unit)
                    .map_err(lf)
            }
            Op::SetXattr {
                path,
                name,
                len,
                seed,
                flags,
            } => {
                let f = XattrFlags {
                    create: flags & libc::XATTR_CREATE != 0,
                    replace: flags & libc::XATTR_REPLACE != 0,
                };
                fs.setxattr(self.ino(path)?, name.as_bytes(), &gen_data(*seed, *len), f)
                    .map(|_| Val::Unit)
                    .map_err(lf)
            }
            Op::SetAcl {
                path,
                default,
                value,
            } => fs
                .setxattr(
                    self.ino(path)?,
                    acl_name(*default).as_bytes(),
                    value,
                    XattrFlags::default(),
                )
                .map(|_| Val::Unit)
                .map_err(lf),
            Op::RemoveXattr { path, name } => fs
                .removexattr(self.ino(path)?, name.as_bytes())
                .map(|_| Val::Unit)
                .map_err(lf),
            Op::GetXattr { path, name } => fs
                .getxattr(self.ino(path)?, name.as_bytes())
                .map(Val::Bytes)
                .map_err(lf),
            Op::ListXattr { path } => {
                let mut v = fs.listxattr(self.ino(path)?).map_err(lf)?;
                v.sort();
                Ok(Val::Names(v))
            }
            Op::Fsync { path, datasync } => fs
                .fsync(self.ino(path)?, *datasync)
                .map(|_| Val::Unit)
                .map_err(lf),
            Op::FsyncDir { path } => fs.fsyncdir(self.ino(path)?).map(|_| Val::Unit).map_err(lf),
            Op::Open { path, h } => {
                let ino = self.ino(path)?;
                fs.open_inode(ino).map_err(lf)?;
                self.handles.insert(*h, ino);
                Ok(Val::Unit)
            }
            Op::Close { h } => {
                let ino = self.handles.remove(h).ok_or_else(|| errf(libc::EBADF))?;
                fs.release(ino).map(|_| Val::Unit).map_err(lf)
            }
            Op::ReadH { h, off, len } => {
                let ino = *self.handles.get(h).ok_or_else(|| errf(libc::EBADF))?;
                self.read_val(ino, *off, *len)
            }
            Op::WriteH { h, off, len, seed } => {
                let ino = *self.handles.get(h).ok_or_else(|| errf(libc::EBADF))?;
                self.write_val(ino, *off, &gen_data(*seed, *len))
            }
            Op::OpenUnlinkRead { path, h, len } => {
                let ino = self.ino(path)?;
                fs.open_inode(ino).map_err(lf)?;
                self.handles.insert(*h, ino);
                let (p, n) = self.parent(path)?;
                fs.unlink(p, &n).map_err(lf)?;
                self.read_val(ino, 0, *len)
            }
            Op::Stat { path } => {
                let a = fs.getattr(self.ino(path)?).map_err(lf)?;
                let kind = Kind::of(a.kind);
                Ok(Val::Stat(StatV {
                    kind,
                    perm: a.perm as u32,
                    nlink: a.nlink as u64,
                    uid: a.uid,
                    gid: a.gid,
                    size: a.size,
                    rdev: match kind {
                        Kind::Chr | Kind::Blk => split_dev32(a.rdev),
                        _ => (0, 0),
                    },
                }))
            }
        }
    }

    fn close_all(&mut self) -> Result<(), String> {
        let hs: Vec<(u32, Ino)> = self.handles.drain().collect();
        for (_, ino) in hs {
            self.fs
                .release(ino)
                .map_err(|e| format!("release({ino}): {e}"))?;
        }
        Ok(())
    }

    fn snapshot(&self, opts: SnapOpts) -> Snapshot {
        snapshot_lib(&self.fs, opts)
    }
}

// ---------------------------------------------------------------- generator

/// One path of the reference (kernel) tree.
#[derive(Clone, Debug)]
struct Info {
    path: String,
    kind: Kind,
    size: u64,
    nlink: u64,
    /// Entries in a directory.
    children: usize,
    xattrs: Vec<String>,
}

/// The kernel tree, sorted by path (lost+found excluded: e2fsck wants it kept).
fn scan(root: &Path) -> Vec<Info> {
    let mut out = Vec::new();
    let mut stack = vec![(root.to_path_buf(), "/".to_string())];
    while let Some((real, shown)) = stack.pop() {
        let st = statx(&real).expect("lstat in kernel tree");
        let kind = Kind::from_mode(st.stx_mode as u32).expect("mode");
        let mut children = 0;
        if kind == Kind::Dir {
            for de in std::fs::read_dir(&real).expect("readdir kernel tree") {
                let de = de.expect("readdir entry");
                let name = de.file_name();
                children += 1;
                if shown == "/" && name.as_bytes() == b"lost+found" {
                    continue;
                }
                stack.push((real.join(&name), join_path(&shown, &name.to_string_lossy())));
            }
        }
        let xattrs = if matches!(kind, Kind::File | Kind::Dir) {
            posix_list_xattrs(&real)
                .unwrap_or_default()
                .into_keys()
                .map(|k| String::from_utf8_lossy(&k).into_owned())
                .collect()
        } else {
            vec![]
        };
        out.push(Info {
            path: shown,
            kind,
            size: st.stx_size,
            nlink: st.stx_nlink as u64,
            children,
            xattrs,
        });
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

const XATTR_NAMES: &[&str] = &[
    "user.a",
    "user.b",
    "user.cc",
    "user.mime_type",
    "user.a_fairly_long_attribute_name_that_takes_space_0123456789",
    "user.x1",
    "user.x2",
    "user.x3",
    "trusted.t",
];
const BIG_XATTR_NAMES: &[&str] = &["user.big1", "user.big2"];

fn acl_name(default: bool) -> &'static str {
    if default {
        "system.posix_acl_default"
    } else {
        "system.posix_acl_access"
    }
}

/// A VFS-format POSIX ACL (version 2, 8-byte entries): owner, named users, group,
/// named groups, mask (if `mask`), other. Named entries without a mask make it
/// invalid (EINVAL), which the generator uses on purpose now and then.
fn acl_bytes(perms: [u16; 4], users: &[(u32, u16)], groups: &[(u32, u16)], mask: bool) -> Vec<u8> {
    const UNDEF: u32 = u32::MAX;
    let mut v = 2u32.to_le_bytes().to_vec();
    let mut push = |tag: u16, perm: u16, id: u32| {
        v.extend(tag.to_le_bytes());
        v.extend(perm.to_le_bytes());
        v.extend(id.to_le_bytes());
    };
    push(0x01, perms[0], UNDEF);
    for &(id, p) in users {
        push(0x02, p, id);
    }
    push(0x04, perms[1], UNDEF);
    for &(id, p) in groups {
        push(0x08, p, id);
    }
    if mask {
        push(0x10, perms[2], UNDEF);
    }
    push(0x20, perms[3], UNDEF);
    v
}

struct Gen {
    rng: StdRng,
    bs: u64,
    next_handle: u32,
    open: Vec<u32>,
    /// Handles whose file was unlinked while open (by OpenUnlinkRead).
    unlinked: Vec<u32>,
    skip: Vec<String>,
}

struct Generated {
    op: Op,
    group: &'static str,
    /// Coverage tags counted when the kernel succeeds.
    tags: Vec<&'static str>,
}

impl Gen {
    fn pick<'a>(&mut self, v: &'a [Info], f: impl Fn(&Info) -> bool) -> Option<&'a Info> {
        let c: Vec<&Info> = v.iter().filter(|i| f(i)).collect();
        if c.is_empty() {
            None
        } else {
            Some(c[self.rng.gen_range(0..c.len())])
        }
    }

    fn name(&mut self) -> String {
        let r = &mut self.rng;
        match r.gen_range(0..100) {
            0..=69 => format!("n{}", r.gen_range(0..120)),
            70..=79 => format!("d{}", r.gen_range(0..40)),
            80..=89 => {
                let len = r.gen_range(30..=255);
                let mut s = format!("long{}_", r.gen_range(0..20));
                while s.len() < len {
                    s.push((b'a' + (s.len() % 26) as u8) as char);
                }
                s
            }
            90..=96 => format!("é{}日本", r.gen_range(0..20)),
            _ => "z".repeat(256), // ENAMETOOLONG
        }
    }

    /// A path for a new entry: mostly in an existing directory; sometimes below a
    /// missing directory (ENOENT) or below a non-directory (ENOTDIR).
    fn new_path(&mut self, t: &[Info]) -> String {
        let name = self.name();
        let r = self.rng.gen_range(0..100);
        if r < 3 {
            return format!("/missing{}/{name}", self.rng.gen_range(0..3));
        }
        if r < 5 {
            // (Not below a symlink: the kernel would follow it, the library's
            // path helper does not.)
            if let Some(f) = self.pick(t, |i| !matches!(i.kind, Kind::Dir | Kind::Symlink)) {
                return join_path(&f.path.clone(), &name);
            }
        }
        let d = self
            .pick(t, |i| i.kind == Kind::Dir)
            .map(|i| i.path.clone())
            .unwrap_or("/".into());
        join_path(&d, &name)
    }

    fn any_path(&mut self, t: &[Info]) -> String {
        if self.rng.gen_range(0..100) < 4 {
            return self.new_path(t);
        }
        self.pick(t, |i| i.path != "/")
            .map(|i| i.path.clone())
            .unwrap_or_else(|| "/nothing".into())
    }

    fn file(&mut self, t: &[Info]) -> Option<Info> {
        self.pick(t, |i| i.kind == Kind::File).cloned()
    }

    fn time(&mut self) -> TimeArg {
        let r = &mut self.rng;
        let nsec = if r.gen_bool(0.2) {
            0
        } else {
            r.gen_range(0..1_000_000_000)
        };
        match r.gen_range(0..10) {
            0 => TimeArg::Now,
            1 => TimeArg::At(r.gen_range(-(1i64 << 31)..0), nsec),
            // Past 2038 (needs the extra epoch bits) but before 2286: e2fsck flags
            // times beyond 2310 as probably-corrupt pre-1970 times.
            2 => TimeArg::At(r.gen_range((1i64 << 31)..10_000_000_000), nsec),
            _ => TimeArg::At(r.gen_range(0..1_600_000_000), nsec),
        }
    }

    fn len(&mut self) -> usize {
        let bs = self.bs as usize;
        let r = &mut self.rng;
        match r.gen_range(0..10) {
            0..=4 => r.gen_range(1..8192),
            5..=7 => bs * r.gen_range(1..64),
            8 => r.gen_range(1..64),
            _ => r.gen_range(65536..300_000),
        }
    }

    fn gen(&mut self, t: &[Info]) -> Generated {
        loop {
            let g = self.gen_one(t);
            if let Some(g) = g {
                if !self.skip.iter().any(|s| s == g.group) {
                    return g;
                }
            }
        }
    }

    fn gen_one(&mut self, t: &[Info]) -> Option<Generated> {
        let n_entries = t.len();
        let huge = t
            .iter()
            .filter(|i| i.kind == Kind::File && i.size > GIB4)
            .count();
        let bs = self.bs;
        let g = |op: Op, group: &'static str, tags: Vec<&'static str>| {
            Some(Generated { op, group, tags })
        };
        // Keep the tree between roughly 50 and 400 entries.
        let w_create = if n_entries > 400 { 1 } else { 10 };
        let w_remove = if n_entries < 50 { 2 } else { 8 };
        let weights: [(u32, u32); 22] = [
            (0, w_create),     // create
            (1, w_create / 2), // mknod
            (2, w_create / 2), // mkdir
            (3, w_remove / 2), // rmdir
            (4, w_remove),     // unlink
            (5, 10),           // rename
            (6, 4),            // link
            (7, 5),            // symlink
            (8, 2),            // readlink
            (9, 18),           // write
            (10, 4),           // read
            (11, 6),           // truncate
            (12, 6),           // fallocate
            (13, 3),           // chmod
            (14, 3),           // chown
            (15, 4),           // utimens
            (16, 10),          // xattr
            (17, 3),           // fsync
            (18, 6),           // handles
            (19, 3),           // stat
            (20, 0),
            (21, 5), // acl
        ];
        let total: u32 = weights.iter().map(|w| w.1).sum();
        let mut x = self.rng.gen_range(0..total);
        let mut which = 0;
        for (k, w) in weights {
            if x < w {
                which = k;
                break;
            }
            x -= w;
        }
        match which {
            0 => {
                let path = self.new_path(t);
                let perm = self.rng.gen_range(0..0o10000);
                g(Op::Create { path, perm }, "create", vec!["create"])
            }
            1 => {
                let path = self.new_path(t);
                let (nt, tag) = match self.rng.gen_range(0..4) {
                    0 => (NodeType::Fifo, "mknod_fifo"),
                    1 => (NodeType::Sock, "mknod_sock"),
                    2 => (NodeType::Chr, "mknod_chr"),
                    _ => (NodeType::Blk, "mknod_blk"),
                };
                let (major, minor) = if self.rng.gen_bool(0.5) {
                    (self.rng.gen_range(0..256), self.rng.gen_range(0..256))
                } else {
                    (
                        self.rng.gen_range(256..4096),
                        self.rng.gen_range(0..1 << 20),
                    )
                };
                let perm = self.rng.gen_range(0..0o10000);
                g(
                    Op::Mknod {
                        path,
                        nt,
                        perm,
                        major,
                        minor,
                    },
                    "mknod",
                    vec![tag],
                )
            }
            2 => {
                let path = self.new_path(t);
                // The VFS strips setuid/setgid from mkdir modes; keep to what passes.
                let perm = self.rng.gen_range(0..0o2000) & 0o1777;
                g(Op::Mkdir { path, perm }, "mkdir", vec!["mkdir"])
            }
            3 => {
                let empty = self.rng.gen_bool(0.7);
                let path = if self.rng.gen_bool(0.85) {
                    self.pick(t, |i| {
                        i.kind == Kind::Dir && i.path != "/" && (!empty || i.children == 0)
                    })
                    .map(|i| i.path.clone())?
                } else {
                    self.any_path(t)
                };
                g(Op::Rmdir { path }, "rmdir", vec!["rmdir"])
            }
            4 => {
                let path = if self.rng.gen_bool(0.9) {
                    self.pick(t, |i| i.kind != Kind::Dir)
                        .map(|i| i.path.clone())?
                } else {
                    self.any_path(t)
                };
                g(Op::Unlink { path }, "unlink", vec!["unlink"])
            }
            5 => {
                let src = self.pick(t, |i| i.path != "/")?.clone();
                let flags = match self.rng.gen_range(0..10) {
                    0 | 1 => libc::RENAME_NOREPLACE,
                    2 | 3 => libc::RENAME_EXCHANGE,
                    _ => 0,
                };
                let r = self.rng.gen_range(0..100);
                let (to, existed) = if r < 45 {
                    // Existing target; prefer one of the same kind (replace works).
                    let same = self.rng.gen_bool(0.6);
                    let k = src.kind;
                    let d = self.pick(t, |i| i.path != "/" && (!same || i.kind == k))?;
                    (d.path.clone(), true)
                } else if r < 50 && src.kind == Kind::Dir {
                    // Into its own subtree (EINVAL) or onto an ancestor.
                    let pre = format!("{}/", src.path);
                    match self.pick(t, |i| i.kind == Kind::Dir && i.path.starts_with(&pre)) {
                        Some(d) => (join_path(&d.path.clone(), "sub"), false),
                        None => (join_path(&src.path, "sub"), false),
                    }
                } else {
                    (self.new_path(t), false)
                };
                let mut tags = vec![];
                match flags {
                    libc::RENAME_NOREPLACE => tags.push("rename_noreplace"),
                    libc::RENAME_EXCHANGE => tags.push("rename_exchange"),
                    _ if existed => tags.push("rename_replace"),
                    _ => tags.push("rename"),
                }
                if src.kind == Kind::Dir && split(&src.path).0 != split(&to).0 {
                    tags.push("rename_dir_cross_parent");
                }
                g(
                    Op::Rename {
                        from: src.path,
                        to,
                        flags,
                    },
                    "rename",
                    tags,
                )
            }
            6 => {
                let from = if self.rng.gen_bool(0.9) {
                    self.pick(t, |i| i.kind != Kind::Dir)
                        .map(|i| i.path.clone())?
                } else {
                    self.any_path(t)
                };
                let to = if self.rng.gen_bool(0.9) {
                    self.new_path(t)
                } else {
                    self.any_path(t)
                };
                g(Op::Link { from, to }, "link", vec!["link"])
            }
            7 => {
                let path = self.new_path(t);
                let r = self.rng.gen_range(0..100);
                let len = if r < 40 {
                    self.rng.gen_range(1..60)
                } else if r < 50 {
                    self.rng.gen_range(59..62)
                } else if r < 95 {
                    self.rng.gen_range(61..bs as usize)
                } else if r < 98 {
                    self.rng.gen_range(bs as usize..bs as usize + 200).min(4095)
                } else {
                    0
                };
                let mut target = Vec::with_capacity(len);
                while target.len() < len {
                    let c = b"abcdefghij/..-_XYZ0123456789"[self.rng.gen_range(0..28)];
                    target.push(c);
                }
                let tag = if len < 60 {
                    "symlink_short"
                } else {
                    "symlink_long"
                };
                g(Op::Symlink { target, path }, "symlink", vec![tag])
            }
            8 => {
                let path = if self.rng.gen_bool(0.8) {
                    self.pick(t, |i| i.kind == Kind::Symlink)
                        .map(|i| i.path.clone())?
                } else {
                    self.any_path(t)
                };
                g(Op::Readlink { path }, "readlink", vec!["readlink"])
            }
            9 => {
                let mut f = self.file(t)?;
                // At most two files above 4 GiB (reading them back costs time):
                // once there are two, writes beyond 4 GiB go to one of them.
                if huge >= 2 && f.size <= GIB4 && self.rng.gen_range(0..12) == 8 {
                    f = self
                        .pick(t, |i| i.kind == Kind::File && i.size > GIB4)?
                        .clone();
                }
                let s = f.size;
                let huge_ok = f.size > GIB4 || huge < 2;
                let len = self.len();
                let (off, tag) = match self.rng.gen_range(0..12) {
                    0 | 1 => (s, "write_append"),
                    2..=4 if s > 0 => (self.rng.gen_range(0..s), "write_overwrite"),
                    5 | 6 => (s + self.rng.gen_range(1..(64 * bs)), "write_sparse"),
                    7 => (self.rng.gen_range(0..(4u64 << 20)), "write"),
                    8 if huge_ok => {
                        let o = if self.rng.gen_bool(0.3) {
                            GIB4 - self.rng.gen_range(1..3 * bs)
                        } else {
                            GIB4 + self.rng.gen_range(0..(64u64 << 20))
                        };
                        (o, "write_beyond_4g")
                    }
                    _ => (self.rng.gen_range(0..=s.min(1 << 20)), "write"),
                };
                let seed = self.rng.gen();
                let tag = if tag == "write" && off > s {
                    "write_sparse"
                } else {
                    tag
                };
                g(
                    Op::Write {
                        path: f.path,
                        off,
                        len,
                        seed,
                    },
                    "write",
                    vec![tag],
                )
            }
            10 => {
                let f = self.file(t)?;
                let off = if f.size > 0 && self.rng.gen_bool(0.8) {
                    self.rng.gen_range(0..f.size)
                } else {
                    self.rng.gen_range(0..f.size + 10_000)
                };
                let len = self.len();
                g(
                    Op::Read {
                        path: f.path,
                        off,
                        len,
                    },
                    "read",
                    vec!["read"],
                )
            }
            11 => {
                let f = if self.rng.gen_bool(0.95) {
                    self.file(t)?
                } else {
                    self.pick(t, |i| i.kind != Kind::Symlink && i.path != "/")?
                        .clone()
                };
                let s = f.size;
                let huge_ok = f.size > GIB4 || huge < 2;
                let size = match self.rng.gen_range(0..10) {
                    0 => 0,
                    1 => s / 2,
                    2 | 3 => s + self.rng.gen_range(1..(2u64 << 20)),
                    4 => s.saturating_sub(self.rng.gen_range(1..3000)),
                    5 => self.rng.gen_range(0..64) * bs,
                    6 if huge_ok => GIB4 + self.rng.gen_range(0..(1u64 << 30)),
                    _ => self.rng.gen_range(0..(2u64 << 20)),
                };
                let tag = if size > s {
                    "truncate_up"
                } else if size < s {
                    "truncate_down"
                } else {
                    "truncate"
                };
                g(Op::Truncate { path: f.path, size }, "truncate", vec![tag])
            }
            12 => {
                let f = self.file(t)?;
                let (mode, tag) = match self.rng.gen_range(0..8) {
                    0 | 1 => (0, "fallocate"),
                    2 | 3 => (libc::FALLOC_FL_KEEP_SIZE, "fallocate_keep_size"),
                    4..=6 => (
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        "fallocate_punch_hole",
                    ),
                    _ => (libc::FALLOC_FL_ZERO_RANGE, "fallocate_zero_range"),
                };
                let s = f.size;
                let off = if s > 0 && self.rng.gen_bool(0.7) {
                    self.rng.gen_range(0..s)
                } else {
                    self.rng.gen_range(0..s + (1 << 20))
                };
                let len = if self.rng.gen_bool(0.5) {
                    self.rng.gen_range(1..(256 * 1024))
                } else {
                    bs * self.rng.gen_range(1..128)
                };
                g(
                    Op::Fallocate {
                        path: f.path,
                        mode,
                        off,
                        len,
                    },
                    "fallocate",
                    vec![tag],
                )
            }
            13 => {
                let path = self.pick(t, |i| i.kind != Kind::Symlink)?.path.clone();
                let mut perm = self.rng.gen_range(0..0o1000);
                if self.rng.gen_bool(0.2) {
                    perm |= self.rng.gen_range(0..8) << 9;
                }
                g(Op::Chmod { path, perm }, "chmod", vec!["chmod"])
            }
            14 => {
                let path = self.pick(t, |_| true)?.path.clone();
                const IDS: [u32; 7] = [0, 1, 1000, 65534, 65536, 100_000, 4_000_000_000];
                let uid = IDS[self.rng.gen_range(0..IDS.len())];
                let gid = IDS[self.rng.gen_range(0..IDS.len())];
                g(Op::Chown { path, uid, gid }, "chown", vec!["chown"])
            }
            15 => {
                let path = self.pick(t, |_| true)?.path.clone();
                let mut atime = self.time();
                let mtime = self.time();
                if self.rng.gen_bool(0.1) {
                    atime = TimeArg::Omit;
                }
                g(
                    Op::Utimens { path, atime, mtime },
                    "utimens",
                    vec!["utimens"],
                )
            }
            16 => {
                // Half the time an entry that already has attributes.
                let with = self.rng.gen_bool(0.5) && t.iter().any(|i| !i.xattrs.is_empty());
                let path = if self.rng.gen_bool(0.97) {
                    self.pick(t, |i| {
                        matches!(i.kind, Kind::File | Kind::Dir) && (!with || !i.xattrs.is_empty())
                    })?
                    .path
                    .clone()
                } else {
                    self.new_path(t)
                };
                // Mostly a name the target has (get/replace/remove then succeed).
                let has: Vec<String> = t
                    .iter()
                    .find(|i| i.path == path)
                    .map(|i| i.xattrs.clone())
                    .unwrap_or_default();
                let name = if !has.is_empty() && self.rng.gen_bool(0.6) {
                    has[self.rng.gen_range(0..has.len())].clone()
                } else if self.rng.gen_bool(0.2) {
                    BIG_XATTR_NAMES[self.rng.gen_range(0..BIG_XATTR_NAMES.len())].to_string()
                } else {
                    XATTR_NAMES[self.rng.gen_range(0..XATTR_NAMES.len())].to_string()
                };
                let big = name.starts_with("user.big");
                match self.rng.gen_range(0..10) {
                    0..=4 => {
                        let (len, tag) = if big {
                            if self.rng.gen_range(0..30) == 0 {
                                (bs as usize + 100, "xattr_set_too_big")
                            } else {
                                (
                                    self.rng.gen_range(100..(bs as usize / 5)),
                                    "xattr_set_large",
                                )
                            }
                        } else {
                            (self.rng.gen_range(0..40), "xattr_set_small")
                        };
                        let (flags, ftag) = match self.rng.gen_range(0..4) {
                            0 => (libc::XATTR_CREATE, "xattr_create"),
                            1 => (libc::XATTR_REPLACE, "xattr_replace"),
                            _ => (0, "xattr_set"),
                        };
                        let seed = self.rng.gen();
                        g(
                            Op::SetXattr {
                                path,
                                name,
                                len,
                                seed,
                                flags,
                            },
                            "xattr",
                            vec![tag, ftag],
                        )
                    }
                    5 | 6 => g(
                        Op::RemoveXattr { path, name },
                        "xattr",
                        vec!["xattr_remove"],
                    ),
                    7 | 8 => g(Op::GetXattr { path, name }, "xattr", vec!["xattr_get"]),
                    _ => g(Op::ListXattr { path }, "xattr", vec!["xattr_list"]),
                }
            }
            17 => {
                if self.rng.gen_bool(0.6) {
                    let path = self.file(t)?.path;
                    let datasync = self.rng.gen_bool(0.3);
                    g(Op::Fsync { path, datasync }, "fsync", vec!["fsync"])
                } else {
                    let path = self.pick(t, |i| i.kind == Kind::Dir)?.path.clone();
                    g(Op::FsyncDir { path }, "fsync", vec!["fsyncdir"])
                }
            }
            18 => {
                let r = self.rng.gen_range(0..10);
                if self.open.len() < 4 && r < 3 {
                    let f = if r == 0 {
                        // A file with one link, so the unlink really orphans it.
                        self.pick(t, |i| i.kind == Kind::File && i.nlink == 1)?
                            .clone()
                    } else {
                        self.file(t)?
                    };
                    let h = self.next_handle;
                    self.next_handle += 1;
                    self.open.push(h);
                    if r == 0 {
                        self.unlinked.push(h);
                        let len = f.size.min(1 << 20) as usize + 10;
                        return g(
                            Op::OpenUnlinkRead {
                                path: f.path,
                                h,
                                len,
                            },
                            "handle",
                            vec!["open_unlink_read"],
                        );
                    }
                    return g(Op::Open { path: f.path, h }, "handle", vec!["open"]);
                }
                if self.open.is_empty() {
                    return None;
                }
                let i = self.rng.gen_range(0..self.open.len());
                let h = self.open[i];
                let orphan = self.unlinked.contains(&h);
                match r {
                    3 | 4 => {
                        self.open.swap_remove(i);
                        self.unlinked.retain(|x| *x != h);
                        let tag = if orphan { "close_unlinked" } else { "close" };
                        g(Op::Close { h }, "handle", vec![tag])
                    }
                    5..=7 => {
                        let off = self.rng.gen_range(0..(1u64 << 20));
                        let len = self.len();
                        let tag = if orphan {
                            "read_unlinked_handle"
                        } else {
                            "read_handle"
                        };
                        g(Op::ReadH { h, off, len }, "handle", vec![tag])
                    }
                    _ => {
                        let off = self.rng.gen_range(0..(1u64 << 20));
                        let len = self.len();
                        let seed = self.rng.gen();
                        g(
                            Op::WriteH { h, off, len, seed },
                            "handle",
                            vec![if orphan {
                                "write_unlinked_handle"
                            } else {
                                "write_handle"
                            }],
                        )
                    }
                }
            }
            21 => {
                // Mostly directories: their default ACLs are inherited by later
                // creates, mkdirs and mknods of the sequence.
                let dir = self.rng.gen_bool(0.6);
                let path = self
                    .pick(t, |i| {
                        i.kind == if dir { Kind::Dir } else { Kind::File } && i.path != "/"
                    })?
                    .path
                    .clone();
                let default = dir && self.rng.gen_bool(0.6) || self.rng.gen_range(0..20) == 0;
                let r = self.rng.gen_range(0..20);
                if r < 3 {
                    return g(
                        Op::RemoveXattr {
                            path,
                            name: acl_name(default).into(),
                        },
                        "acl",
                        vec!["acl_remove"],
                    );
                }
                if r < 5 {
                    return g(
                        Op::GetXattr {
                            path,
                            name: acl_name(default).into(),
                        },
                        "acl",
                        vec!["acl_get"],
                    );
                }
                let mut perms = [0u16; 4];
                for p in &mut perms {
                    *p = self.rng.gen_range(0..8);
                }
                const IDS: [u32; 3] = [0, 1000, 4242];
                let mut users = vec![];
                let mut groups = vec![];
                let named = self.rng.gen_bool(0.6);
                if named {
                    for id in IDS {
                        if self.rng.gen_bool(0.4) {
                            users.push((id, self.rng.gen_range(0..8)));
                        }
                        if self.rng.gen_bool(0.3) {
                            groups.push((id, self.rng.gen_range(0..8)));
                        }
                    }
                }
                let needs_mask = !users.is_empty() || !groups.is_empty();
                let broken = needs_mask && self.rng.gen_range(0..15) == 0;
                let mask = (needs_mask && !broken) || self.rng.gen_bool(0.1);
                let value = acl_bytes(perms, &users, &groups, mask);
                let tag = match (default, mask) {
                    _ if broken => "acl_set_invalid",
                    (true, _) => "acl_set_default",
                    (false, true) => "acl_set_access",
                    (false, false) => "acl_set_access_equiv",
                };
                g(
                    Op::SetAcl {
                        path,
                        default,
                        value,
                    },
                    "acl",
                    vec![tag],
                )
            }
            _ => {
                let path = self.any_path(t);
                g(Op::Stat { path }, "stat", vec!["stat"])
            }
        }
    }
}

/// Operation kinds that must have succeeded at least once on the kernel side, so
/// the sequence really covers what the acceptance point lists.
const REQUIRED: &[&str] = &[
    "create",
    "mknod_fifo",
    "mknod_sock",
    "mknod_chr",
    "mknod_blk",
    "mkdir",
    "rmdir",
    "unlink",
    "open_unlink_read",
    "read_unlinked_handle",
    "close_unlinked",
    "rename",
    "rename_replace",
    "rename_noreplace",
    "rename_exchange",
    "rename_dir_cross_parent",
    "link",
    "symlink_short",
    "symlink_long",
    "readlink",
    "write_sparse",
    "write_overwrite",
    "write_append",
    "write_beyond_4g",
    "truncate_up",
    "truncate_down",
    "fallocate_keep_size",
    "fallocate_punch_hole",
    "chmod",
    "chown",
    "utimens",
    "xattr_set_small",
    "xattr_set_large",
    "xattr_replace",
    "xattr_remove",
    "acl_set_access",
    "acl_set_access_equiv",
    "acl_set_default",
    "acl_remove",
    "fsync",
    "fsyncdir",
];

// ---------------------------------------------------------------- driver

struct Case {
    name: &'static str,
    default_seed: u64,
    mkfs: &'static [&'static str],
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    if let Some(h) = v.strip_prefix("0x") {
        u64::from_str_radix(h, 16).ok()
    } else {
        v.parse().ok()
    }
}

/// Run the sequence on the kernel mount and on `other`, comparing every result.
/// Panics at the first mismatch, or (COMMITFS_DIFF_KEEP_GOING=1) returns them all
/// so the caller can still compare the final trees before failing.
#[allow(clippy::too_many_arguments)]
fn run_sequence(
    case: &Case,
    seed: u64,
    nops: usize,
    bs: u64,
    kroot: &Path,
    other: &mut dyn Target,
    other_name: &str,
    t0: i64,
) -> Mismatches {
    let mut kernel = PosixTarget {
        root: kroot.to_path_buf(),
        handles: HashMap::new(),
    };
    let skip: Vec<String> = std::env::var("COMMITFS_DIFF_SKIP")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.trim().to_string())
        .collect();
    let keep_going = std::env::var("COMMITFS_DIFF_KEEP_GOING").is_ok_and(|v| v == "1");
    let mut gen = Gen {
        rng: StdRng::seed_from_u64(seed),
        bs,
        next_handle: 1,
        open: vec![],
        unlinked: vec![],
        skip,
    };
    let mut covered: BTreeMap<&'static str, (usize, usize)> = BTreeMap::new();
    let mut history: Vec<String> = Vec::new();
    let mut mismatches: Vec<String> = Vec::new();
    let repro = format!(
        "COMMITFS_DIFF_SEED={seed} COMMITFS_DIFF_OPS=<n> cargo test -p commitfs --test differential {}",
        case.name
    );
    // COMMITFS_DIFF_LOG=<file>: every operation and both results, for debugging.
    let mut log = std::env::var_os("COMMITFS_DIFF_LOG")
        .map(|p| std::fs::File::create(p).expect("create log"));
    let mut tree = scan(kroot);
    for i in 0..nops {
        let g = gen.gen(&tree);
        let rk = kernel.apply(&g.op);
        let ro = match catch_unwind(AssertUnwindSafe(|| other.apply(&g.op))) {
            Ok(r) => r,
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!(
                    "[{}] seed {seed}: op #{i} {:?} PANICKED in {other_name}: {msg}\nrecent ops:\n  {}\nrepro: {repro}",
                    case.name,
                    g.op,
                    history.join("\n  ")
                );
            }
        };
        let line = format!(
            "#{i} {:?} -> kernel {} / {other_name} {}",
            g.op,
            show(&rk),
            show(&ro)
        );
        if let Some(f) = log.as_mut() {
            use std::io::Write;
            let _ = writeln!(f, "{line}");
        }
        history.push(line.clone());
        if history.len() > 25 {
            history.remove(0);
        }
        for t in &g.tags {
            let e = covered.entry(t).or_default();
            if rk.is_ok() {
                e.0 += 1;
            } else {
                e.1 += 1;
            }
        }
        // A failed open leaves no handle: forget it on both sides (a differing
        // result was already caught above).
        if let Op::Open { h, .. } | Op::OpenUnlinkRead { h, .. } = &g.op {
            if !kernel.handles.contains_key(h) {
                let h = *h;
                gen.open.retain(|x| *x != h);
                gen.unlinked.retain(|x| *x != h);
                let _ = other.apply(&Op::Close { h });
            }
        }
        if !same(&rk, &ro) {
            let m = format!("[{}] seed {seed}: result mismatch at {line}", case.name);
            if !keep_going {
                panic!(
                    "{m}\nrecent ops:\n  {}\nrepro: {repro} (n = {})",
                    history.join("\n  "),
                    i + 1
                );
            }
            eprintln!("{m}");
            mismatches.push(m);
        }
        if rk.is_ok()
            && !matches!(
                g.op,
                Op::Read { .. }
                    | Op::ReadH { .. }
                    | Op::Stat { .. }
                    | Op::Readlink { .. }
                    | Op::GetXattr { .. }
                    | Op::ListXattr { .. }
            )
        {
            tree = scan(kroot);
        }
        // Checkpoint: metadata of the whole tree (no file contents, cheap), so a
        // divergence that no result shows is caught near where it happened.
        if (i + 1) % CHECKPOINT_EVERY == 0 {
            let o = SnapOpts {
                content: false,
                xattrs: true,
            };
            let d = compare(
                &kernel.snapshot(o),
                "kernel",
                &other.snapshot(o),
                other_name,
                recent(t0),
            );
            if !d.is_empty() {
                let m = format!(
                    "[{}] seed {seed}: trees differ after op #{i} (first difference since op #{}):\n  {}",
                    case.name,
                    i + 1 - CHECKPOINT_EVERY,
                    d.iter().take(20).cloned().collect::<Vec<_>>().join("\n  ")
                );
                if !keep_going {
                    panic!(
                        "{m}\nrecent ops:\n  {}\nrepro: {repro}",
                        history.join("\n  ")
                    );
                }
                eprintln!("{m}");
                if !mismatches.iter().any(|x| x.contains("trees differ after")) {
                    mismatches.push(m);
                }
            }
        }
    }
    kernel.close_all().expect("close kernel handles");
    other
        .close_all()
        .unwrap_or_else(|e| panic!("[{}] seed {seed}: {other_name} close_all: {e}", case.name));
    eprintln!(
        "[{}] seed {seed}: {nops} ops; coverage (ok, err): {covered:?}",
        case.name
    );
    if nops >= 2000 && gen.skip.is_empty() {
        let missing: Vec<&&str> = REQUIRED
            .iter()
            .filter(|t| covered.get(**t).is_none_or(|c| c.0 == 0))
            .collect();
        assert!(
            missing.is_empty(),
            "[{}] seed {seed}: sequence never succeeded at {missing:?}",
            case.name
        );
    }
    Mismatches(mismatches)
}

/// Result mismatches collected in keep-going mode; checked when dropped (at the
/// end of the test, after the final tree comparison had its say).
struct Mismatches(Vec<String>);

impl Drop for Mismatches {
    fn drop(&mut self) {
        if !self.0.is_empty() && !std::thread::panicking() {
            panic!("{} result mismatches:\n{}", self.0.len(), self.0.join("\n"));
        }
    }
}

fn block_size_of(case: &Case) -> u64 {
    let pos = case
        .mkfs
        .iter()
        .position(|a| *a == "-b")
        .expect("cases pass -b");
    case.mkfs[pos + 1].parse().expect("block size")
}

fn setup(case: &Case) -> (u64, usize, i64, TempImage) {
    umask0();
    let seed = env_u64("COMMITFS_DIFF_SEED").unwrap_or(case.default_seed);
    let nops = env_u64("COMMITFS_DIFF_OPS")
        .map(|n| n as usize)
        .unwrap_or(2000);
    eprintln!(
        "[{}] seed {seed} ({nops} ops): set COMMITFS_DIFF_SEED={seed} to reproduce",
        case.name
    );
    let t0 = now_secs();
    let img = mkfs(case.name, IMAGE_MIB, case.mkfs);
    (seed, nops, t0, img)
}

fn recent(t0: i64) -> CompareOpts {
    CompareOpts {
        times: TimeMode::Recent {
            lo: t0 - 5,
            hi: now_secs() + 5,
        },
        dir_sizes: true,
        atime: true,
    }
}

const EXACT: CompareOpts = CompareOpts {
    times: TimeMode::Exact,
    dir_sizes: true,
    atime: true,
};

/// Library vs kernel.
fn lib_case(case: &Case) {
    let (seed, nops, t0, fresh) = setup(case);
    let bs = block_size_of(case);
    let kimg = copy_sparse(&fresh.path, "diff-kernel");
    let limg = copy_sparse(&fresh.path, "diff-lib");
    drop(fresh);
    let mut km = KernelMount::mount(&kimg.path, "noatime").expect("kernel mount");
    let fs = open_lib(&limg.path, false).expect("library mount");
    let mut lib = LibTarget {
        fs,
        handles: HashMap::new(),
    };
    let _m = run_sequence(case, seed, nops, bs, km.path(), &mut lib, "commitfs", t0);

    let ctx = format!("[{}] seed {seed}", case.name);
    let ks = snapshot_posix(km.path(), SnapOpts::default());
    // Cached data is allocated at write-back, and extent blocks it needs only
    // count in st_blocks from then on (as with ext4's delalloc): the view the
    // image must reproduce exactly is the one after a sync.
    lib.fs
        .sync()
        .unwrap_or_else(|e| panic!("[{}] seed {seed}: sync: {e}", case.name));
    let ls = snapshot_lib(&lib.fs, SnapOpts::default());
    eprintln!("{ctx}: final tree has {} entries", ks.entries.len());
    assert_same(
        &ks,
        "kernel",
        &ls,
        "commitfs",
        recent(t0),
        &format!("{ctx}: final trees"),
    );

    lib.fs
        .unmount()
        .unwrap_or_else(|e| panic!("{ctx}: commitfs unmount: {e}"));
    drop(lib);
    km.unmount()
        .unwrap_or_else(|e| panic!("{ctx}: kernel unmount: {e}"));
    check_fsck(&kimg.path, "kernel image")
        .unwrap_or_else(|e| panic!("{ctx}: harness problem: {e}"));
    check_fsck(&limg.path, "commitfs image").unwrap_or_else(|e| panic!("{ctx}: {e}"));

    // What commitfs wrote must read back the same: by commitfs after a remount ...
    let fs = open_lib(&limg.path, true).unwrap_or_else(|e| panic!("{ctx}: commitfs remount: {e}"));
    let ls2 = snapshot_lib(&fs, SnapOpts::default());
    drop(fs);
    assert_same(
        &ls,
        "commitfs",
        &ls2,
        "commitfs-remounted",
        EXACT,
        &format!("{ctx}: after remount"),
    );
    // ... and by the kernel.
    let mut km2 = KernelMount::mount(&limg.path, "ro,noatime")
        .unwrap_or_else(|e| panic!("{ctx}: kernel mount of commitfs image: {e}"));
    let ks2 = snapshot_posix(km2.path(), SnapOpts::default());
    km2.unmount().expect("unmount");
    assert_same(
        &ls,
        "commitfs",
        &ks2,
        "kernel-reading-commitfs-image",
        EXACT,
        &format!("{ctx}: kernel view of commitfs image"),
    );
    check_fsck(&limg.path, "commitfs image after kernel ro mount")
        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
}

/// FUSE mount vs kernel.
fn fuse_case(case: &Case) {
    let (seed, nops, t0, fresh) = setup(case);
    let bs = block_size_of(case);
    let kimg = copy_sparse(&fresh.path, "diff-kernel");
    let fimg = copy_sparse(&fresh.path, "diff-fuse");
    drop(fresh);
    let ctx = format!("[{}] seed {seed}", case.name);
    let mut km = KernelMount::mount(&kimg.path, "noatime").expect("kernel mount");
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_commitfs"));
    let mut fm = FuseMount::mount(&bin, &fimg.path, &["-o", "noatime"])
        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let wd = Watchdog::new(ctx.clone(), 600, fm.pid(), Some(fm.path().to_path_buf()));
    let mut fuse = PosixTarget {
        root: fm.path().to_path_buf(),
        handles: HashMap::new(),
    };
    let _m = run_sequence(case, seed, nops, bs, km.path(), &mut fuse, "fuse", t0);

    let ks = snapshot_posix(km.path(), SnapOpts::default());
    // As in lib_case, the exact view is the one after write-back: an fsync of
    // the root directory makes every cached write durable (its commit's cut
    // takes all of them); FUSE has no syncfs for `sync` to reach the daemon.
    std::fs::File::open(fm.path())
        .and_then(|d| d.sync_all())
        .unwrap_or_else(|e| panic!("{ctx}: fsync of the mount root: {e}"));
    let fs_snap = snapshot_posix(fm.path(), SnapOpts::default());
    eprintln!("{ctx}: final tree has {} entries", ks.entries.len());
    assert_same(
        &ks,
        "kernel",
        &fs_snap,
        "fuse",
        recent(t0),
        &format!("{ctx}: final trees"),
    );
    drop(fuse);
    fm.unmount()
        .unwrap_or_else(|e| panic!("{ctx}: FUSE unmount: {e}"));
    drop(wd);
    km.unmount()
        .unwrap_or_else(|e| panic!("{ctx}: kernel unmount: {e}"));
    check_fsck(&kimg.path, "kernel image")
        .unwrap_or_else(|e| panic!("{ctx}: harness problem: {e}"));
    check_fsck(&fimg.path, "commitfs (FUSE) image").unwrap_or_else(|e| panic!("{ctx}: {e}"));

    // The image must hold what the FUSE mount showed: read it with the kernel.
    let mut km2 = KernelMount::mount(&fimg.path, "ro,noatime")
        .unwrap_or_else(|e| panic!("{ctx}: kernel mount of commitfs image: {e}"));
    let ks2 = snapshot_posix(km2.path(), SnapOpts::default());
    km2.unmount().expect("unmount");
    let o = CompareOpts {
        times: TimeMode::Exact,
        dir_sizes: true,
        atime: true,
    };
    assert_same(
        &fs_snap,
        "fuse",
        &ks2,
        "kernel-reading-commitfs-image",
        o,
        &format!("{ctx}: kernel view of FUSE-written image"),
    );
}

/// The harness itself: two kernel mounts of identical images must agree on every
/// result and on the final tree (guards against false alarms in the comparison).
#[test]
fn harness_kernel_vs_kernel() {
    let case = Case {
        name: "harness_kernel_vs_kernel",
        default_seed: 0x6e6e_0001,
        mkfs: &["-b", "1024", "-O", "fast_commit"],
    };
    let (seed, nops, t0, fresh) = setup(&case);
    let a = copy_sparse(&fresh.path, "diff-ka");
    let b = copy_sparse(&fresh.path, "diff-kb");
    drop(fresh);
    let mut ka = KernelMount::mount(&a.path, "noatime").expect("kernel mount");
    let mut kb = KernelMount::mount(&b.path, "noatime").expect("kernel mount");
    let mut other = PosixTarget {
        root: kb.path().to_path_buf(),
        handles: HashMap::new(),
    };
    let _m = run_sequence(
        &case,
        seed,
        nops,
        1024,
        ka.path(),
        &mut other,
        "kernel-2",
        t0,
    );
    let sa = snapshot_posix(ka.path(), SnapOpts::default());
    let sb = snapshot_posix(kb.path(), SnapOpts::default());
    assert_same(&sa, "kernel-1", &sb, "kernel-2", recent(t0), "harness");
    ka.unmount().expect("unmount");
    kb.unmount().expect("unmount");
    check_fsck(&a.path, "kernel image 1").unwrap();
    check_fsck(&b.path, "kernel image 2").unwrap();
}

#[test]
fn lib_vs_kernel_1k() {
    lib_case(&Case {
        name: "lib_vs_kernel_1k",
        default_seed: 0x1c0f_fee1,
        mkfs: &["-b", "1024"],
    });
}

#[test]
fn lib_vs_kernel_4k_fast_commit_orphan_file() {
    lib_case(&Case {
        name: "lib_vs_kernel_4k_fast_commit_orphan_file",
        default_seed: 0x4c0f_fee4,
        mkfs: &[
            "-b",
            "4096",
            "-O",
            "fast_commit,metadata_csum_seed,orphan_file",
        ],
    });
}

#[test]
fn fuse_vs_kernel_1k_orphan_file() {
    fuse_case(&Case {
        name: "fuse_vs_kernel_1k_orphan_file",
        default_seed: 0xf05e_0001,
        mkfs: &["-b", "1024", "-O", "metadata_csum_seed,orphan_file"],
    });
}

#[test]
fn fuse_vs_kernel_4k_fast_commit() {
    fuse_case(&Case {
        name: "fuse_vs_kernel_4k_fast_commit",
        default_seed: 0xf05e_0004,
        mkfs: &["-b", "4096", "-O", "fast_commit"],
    });
}
