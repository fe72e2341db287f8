//! `commitfs demo [--dir DIR] [--keep]`: make a 256 MiB image, mount it with FUSE
//! (or use the library directly when FUSE is unavailable), run a small real
//! workload, verify what reads back, unmount, and let `e2fsck -fn` judge the image.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, ensure, Context, Result};
use commitfs_device::StatsSnapshot;
use commitfs_fs::{Fs, FsError, Ino, MountOptions, RenameFlags, SetAttr, XattrFlags};
use commitfs_fuse::{BackgroundMount, FuseConfig};

use super::mkfs::{self, MkfsOptions};
use super::size::human;

/// The operations the workload needs, served either through the FUSE mount
/// (plain system calls) or by the library directly.
trait Target {
    fn mkdir(&mut self, p: &str) -> Result<()>;
    /// Create or truncate, then write `data`.
    fn write_file(&mut self, p: &str, data: &[u8]) -> Result<()>;
    fn append(&mut self, p: &str, data: &[u8]) -> Result<()>;
    fn write_at(&mut self, p: &str, off: u64, data: &[u8]) -> Result<()>;
    fn truncate(&mut self, p: &str, len: u64) -> Result<()>;
    fn read(&mut self, p: &str) -> Result<Vec<u8>>;
    fn rename(&mut self, from: &str, to: &str) -> Result<()>;
    fn link(&mut self, from: &str, to: &str) -> Result<()>;
    fn symlink(&mut self, target: &str, p: &str) -> Result<()>;
    fn readlink(&mut self, p: &str) -> Result<String>;
    fn set_xattr(&mut self, p: &str, name: &str, value: &[u8]) -> Result<()>;
    fn get_xattr(&mut self, p: &str, name: &str) -> Result<Vec<u8>>;
    fn list_xattr(&mut self, p: &str) -> Result<Vec<String>>;
    fn remove_xattr(&mut self, p: &str, name: &str) -> Result<()>;
    fn unlink(&mut self, p: &str) -> Result<()>;
    fn rmdir(&mut self, p: &str) -> Result<()>;
    fn fsync(&mut self, p: &str) -> Result<()>;
    /// Names in a directory, without "." and "..".
    fn list(&mut self, p: &str) -> Result<Vec<String>>;
    fn nlink(&mut self, p: &str) -> Result<u64>;
    /// Open `p`, unlink it, read it through the still-open handle, close it.
    fn read_after_unlink(&mut self, p: &str) -> Result<Vec<u8>>;
}

// ------------------------------------------------------------------ POSIX target

struct Posix {
    root: PathBuf,
}

impl Posix {
    fn p(&self, p: &str) -> PathBuf {
        self.root.join(p.trim_start_matches('/'))
    }
    fn c(&self, p: &str) -> Result<CString> {
        Ok(CString::new(self.p(p).as_os_str().as_bytes())?)
    }
}

fn os_err(what: &str, p: &str) -> anyhow::Error {
    anyhow!("{what} {p}: {}", std::io::Error::last_os_error())
}

impl Target for Posix {
    fn mkdir(&mut self, p: &str) -> Result<()> {
        std::fs::create_dir(self.p(p)).with_context(|| format!("mkdir {p}"))
    }
    fn write_file(&mut self, p: &str, data: &[u8]) -> Result<()> {
        std::fs::write(self.p(p), data).with_context(|| format!("write {p}"))
    }
    fn append(&mut self, p: &str, data: &[u8]) -> Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(self.p(p))
            .with_context(|| format!("open {p} for append"))?;
        f.write_all(data).with_context(|| format!("append {p}"))
    }
    fn write_at(&mut self, p: &str, off: u64, data: &[u8]) -> Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(self.p(p))
            .with_context(|| format!("open {p}"))?;
        f.seek(SeekFrom::Start(off))?;
        f.write_all(data).with_context(|| format!("overwrite {p}"))
    }
    fn truncate(&mut self, p: &str, len: u64) -> Result<()> {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(self.p(p))
            .with_context(|| format!("open {p}"))?;
        f.set_len(len).with_context(|| format!("truncate {p}"))
    }
    fn read(&mut self, p: &str) -> Result<Vec<u8>> {
        std::fs::read(self.p(p)).with_context(|| format!("read {p}"))
    }
    fn rename(&mut self, from: &str, to: &str) -> Result<()> {
        std::fs::rename(self.p(from), self.p(to)).with_context(|| format!("rename {from} {to}"))
    }
    fn link(&mut self, from: &str, to: &str) -> Result<()> {
        std::fs::hard_link(self.p(from), self.p(to)).with_context(|| format!("link {from} {to}"))
    }
    fn symlink(&mut self, target: &str, p: &str) -> Result<()> {
        std::os::unix::fs::symlink(target, self.p(p)).with_context(|| format!("symlink {p}"))
    }
    fn readlink(&mut self, p: &str) -> Result<String> {
        let t = std::fs::read_link(self.p(p)).with_context(|| format!("readlink {p}"))?;
        Ok(t.to_string_lossy().into_owned())
    }
    fn set_xattr(&mut self, p: &str, name: &str, value: &[u8]) -> Result<()> {
        let (c, n) = (self.c(p)?, CString::new(name)?);
        // SAFETY: valid NUL-terminated strings and a value slice.
        let r = unsafe {
            libc::setxattr(
                c.as_ptr(),
                n.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if r != 0 {
            return Err(os_err("setxattr", p));
        }
        Ok(())
    }
    fn get_xattr(&mut self, p: &str, name: &str) -> Result<Vec<u8>> {
        let (c, n) = (self.c(p)?, CString::new(name)?);
        let mut buf = vec![0u8; 65536];
        // SAFETY: buffer pointer and length describe `buf`.
        let r =
            unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if r < 0 {
            return Err(os_err("getxattr", p));
        }
        buf.truncate(r as usize);
        Ok(buf)
    }
    fn list_xattr(&mut self, p: &str) -> Result<Vec<String>> {
        let c = self.c(p)?;
        let mut buf = vec![0u8; 65536];
        // SAFETY: buffer pointer and length describe `buf`.
        let r = unsafe { libc::listxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if r < 0 {
            return Err(os_err("listxattr", p));
        }
        buf.truncate(r as usize);
        Ok(buf
            .split(|&b| b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect())
    }
    fn remove_xattr(&mut self, p: &str, name: &str) -> Result<()> {
        let (c, n) = (self.c(p)?, CString::new(name)?);
        // SAFETY: valid NUL-terminated strings.
        if unsafe { libc::removexattr(c.as_ptr(), n.as_ptr()) } != 0 {
            return Err(os_err("removexattr", p));
        }
        Ok(())
    }
    fn unlink(&mut self, p: &str) -> Result<()> {
        std::fs::remove_file(self.p(p)).with_context(|| format!("unlink {p}"))
    }
    fn rmdir(&mut self, p: &str) -> Result<()> {
        std::fs::remove_dir(self.p(p)).with_context(|| format!("rmdir {p}"))
    }
    fn fsync(&mut self, p: &str) -> Result<()> {
        let f = std::fs::File::open(self.p(p)).with_context(|| format!("open {p}"))?;
        f.sync_all().with_context(|| format!("fsync {p}"))
    }
    fn list(&mut self, p: &str) -> Result<Vec<String>> {
        let mut v = Vec::new();
        for e in std::fs::read_dir(self.p(p)).with_context(|| format!("readdir {p}"))? {
            v.push(e?.file_name().to_string_lossy().into_owned());
        }
        Ok(v)
    }
    fn nlink(&mut self, p: &str) -> Result<u64> {
        Ok(std::fs::symlink_metadata(self.p(p))
            .with_context(|| format!("stat {p}"))?
            .nlink())
    }
    fn read_after_unlink(&mut self, p: &str) -> Result<Vec<u8>> {
        let mut f = std::fs::File::open(self.p(p)).with_context(|| format!("open {p}"))?;
        std::fs::remove_file(self.p(p)).with_context(|| format!("unlink {p}"))?;
        let mut v = Vec::new();
        f.read_to_end(&mut v)
            .with_context(|| format!("read unlinked {p}"))?;
        Ok(v)
    }
}

// --------------------------------------------------------------- library target

struct Lib {
    fs: Arc<Fs>,
}

fn lib_err(what: &str, p: &str, e: FsError) -> anyhow::Error {
    anyhow!("{what} {p}: {e}")
}

impl Lib {
    fn split(p: &str) -> (&str, &str) {
        let p = p.trim_end_matches('/');
        match p.rfind('/') {
            Some(i) => (&p[..i], &p[i + 1..]),
            None => ("", p),
        }
    }
    fn ino(&self, p: &str) -> Result<Ino> {
        self.fs.resolve(p).map_err(|e| lib_err("resolve", p, e))
    }
    fn parent(&self, p: &str) -> Result<(Ino, String)> {
        let (d, n) = Self::split(p);
        Ok((self.ino(d)?, n.to_string()))
    }
}

impl Target for Lib {
    fn mkdir(&mut self, p: &str) -> Result<()> {
        let (d, n) = self.parent(p)?;
        self.fs
            .mkdir(d, n.as_bytes(), 0o755, 0, 0)
            .map_err(|e| lib_err("mkdir", p, e))?;
        Ok(())
    }
    fn write_file(&mut self, p: &str, data: &[u8]) -> Result<()> {
        let (d, n) = self.parent(p)?;
        let ino = match self.fs.lookup(d, n.as_bytes()) {
            Ok(a) => {
                let set = SetAttr {
                    size: Some(0),
                    ..Default::default()
                };
                self.fs
                    .setattr(a.ino, &set)
                    .map_err(|e| lib_err("truncate", p, e))?;
                a.ino
            }
            Err(FsError::NotFound) => {
                self.fs
                    .create(d, n.as_bytes(), 0o644, 0, 0)
                    .map_err(|e| lib_err("create", p, e))?
                    .ino
            }
            Err(e) => return Err(lib_err("lookup", p, e)),
        };
        self.write_ino(ino, p, 0, data)
    }
    fn append(&mut self, p: &str, data: &[u8]) -> Result<()> {
        let ino = self.ino(p)?;
        let size = self
            .fs
            .getattr(ino)
            .map_err(|e| lib_err("stat", p, e))?
            .size;
        self.write_ino(ino, p, size, data)
    }
    fn write_at(&mut self, p: &str, off: u64, data: &[u8]) -> Result<()> {
        let ino = self.ino(p)?;
        self.write_ino(ino, p, off, data)
    }
    fn truncate(&mut self, p: &str, len: u64) -> Result<()> {
        let ino = self.ino(p)?;
        let set = SetAttr {
            size: Some(len),
            ..Default::default()
        };
        self.fs
            .setattr(ino, &set)
            .map_err(|e| lib_err("truncate", p, e))?;
        Ok(())
    }
    fn read(&mut self, p: &str) -> Result<Vec<u8>> {
        let ino = self.ino(p)?;
        self.read_ino(ino, p)
    }
    fn rename(&mut self, from: &str, to: &str) -> Result<()> {
        let (a, an) = self.parent(from)?;
        let (b, bn) = self.parent(to)?;
        self.fs
            .rename(a, an.as_bytes(), b, bn.as_bytes(), RenameFlags::default())
            .map_err(|e| lib_err("rename", from, e))
    }
    fn link(&mut self, from: &str, to: &str) -> Result<()> {
        let ino = self.ino(from)?;
        let (b, bn) = self.parent(to)?;
        self.fs
            .link(ino, b, bn.as_bytes())
            .map_err(|e| lib_err("link", to, e))?;
        Ok(())
    }
    fn symlink(&mut self, target: &str, p: &str) -> Result<()> {
        let (d, n) = self.parent(p)?;
        self.fs
            .symlink(d, n.as_bytes(), target.as_bytes(), 0, 0)
            .map_err(|e| lib_err("symlink", p, e))?;
        Ok(())
    }
    fn readlink(&mut self, p: &str) -> Result<String> {
        let ino = self.ino(p)?;
        let t = self
            .fs
            .readlink(ino)
            .map_err(|e| lib_err("readlink", p, e))?;
        Ok(String::from_utf8_lossy(&t).into_owned())
    }
    fn set_xattr(&mut self, p: &str, name: &str, value: &[u8]) -> Result<()> {
        let ino = self.ino(p)?;
        self.fs
            .setxattr(ino, name.as_bytes(), value, XattrFlags::default())
            .map_err(|e| lib_err("setxattr", p, e))
    }
    fn get_xattr(&mut self, p: &str, name: &str) -> Result<Vec<u8>> {
        let ino = self.ino(p)?;
        self.fs
            .getxattr(ino, name.as_bytes())
            .map_err(|e| lib_err("getxattr", p, e))
    }
    fn list_xattr(&mut self, p: &str) -> Result<Vec<String>> {
        let ino = self.ino(p)?;
        let v = self
            .fs
            .listxattr(ino)
            .map_err(|e| lib_err("listxattr", p, e))?;
        Ok(v.into_iter()
            .map(|n| String::from_utf8_lossy(&n).into_owned())
            .collect())
    }
    fn remove_xattr(&mut self, p: &str, name: &str) -> Result<()> {
        let ino = self.ino(p)?;
        self.fs
            .removexattr(ino, name.as_bytes())
            .map_err(|e| lib_err("removexattr", p, e))
    }
    fn unlink(&mut self, p: &str) -> Result<()> {
        let (d, n) = self.parent(p)?;
        self.fs
            .unlink(d, n.as_bytes())
            .map_err(|e| lib_err("unlink", p, e))
    }
    fn rmdir(&mut self, p: &str) -> Result<()> {
        let (d, n) = self.parent(p)?;
        self.fs
            .rmdir(d, n.as_bytes())
            .map_err(|e| lib_err("rmdir", p, e))
    }
    fn fsync(&mut self, p: &str) -> Result<()> {
        let ino = self.ino(p)?;
        self.fs
            .fsync(ino, false)
            .map_err(|e| lib_err("fsync", p, e))
    }
    fn list(&mut self, p: &str) -> Result<Vec<String>> {
        let ino = self.ino(p)?;
        let v = self
            .fs
            .readdir_all(ino)
            .map_err(|e| lib_err("readdir", p, e))?;
        Ok(v.into_iter()
            .filter(|e| e.name != b"." && e.name != b"..")
            .map(|e| String::from_utf8_lossy(&e.name).into_owned())
            .collect())
    }
    fn nlink(&mut self, p: &str) -> Result<u64> {
        let ino = self.ino(p)?;
        Ok(self
            .fs
            .getattr(ino)
            .map_err(|e| lib_err("stat", p, e))?
            .nlink as u64)
    }
    fn read_after_unlink(&mut self, p: &str) -> Result<Vec<u8>> {
        let ino = self.ino(p)?;
        self.fs.open_inode(ino).map_err(|e| lib_err("open", p, e))?;
        let r = self.unlink(p).and_then(|()| self.read_ino(ino, p));
        self.fs.release(ino).map_err(|e| lib_err("close", p, e))?;
        r
    }
}

impl Lib {
    fn write_ino(&self, ino: Ino, p: &str, mut off: u64, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            let n = self
                .fs
                .write(ino, off, data)
                .map_err(|e| lib_err("write", p, e))?;
            ensure!(n > 0, "write {p}: wrote nothing");
            off += n as u64;
            data = &data[n..];
        }
        Ok(())
    }
    fn read_ino(&self, ino: Ino, p: &str) -> Result<Vec<u8>> {
        let size = self
            .fs
            .getattr(ino)
            .map_err(|e| lib_err("stat", p, e))?
            .size;
        let mut v = vec![0u8; size as usize];
        let mut off = 0usize;
        while off < v.len() {
            let n = self
                .fs
                .read(ino, off as u64, &mut v[off..])
                .map_err(|e| lib_err("read", p, e))?;
            if n == 0 {
                break;
            }
            off += n;
        }
        v.truncate(off);
        Ok(v)
    }
}

// ---------------------------------------------------------------- the workload

#[derive(Debug, Clone, PartialEq)]
enum Node {
    Dir,
    File(Vec<u8>),
    Symlink(String),
}

/// Runs operations on a target and on an in-memory model, counting them.
struct Workload<'a> {
    t: &'a mut dyn Target,
    model: BTreeMap<String, Node>,
    ops: u64,
    bytes_written: u64,
    bytes_read: u64,
    seed: u64,
}

impl Workload<'_> {
    fn data(&mut self, len: usize) -> Vec<u8> {
        // xorshift: deterministic, incompressible-looking content.
        let mut v = Vec::with_capacity(len);
        while v.len() < len {
            self.seed ^= self.seed << 13;
            self.seed ^= self.seed >> 7;
            self.seed ^= self.seed << 17;
            v.extend_from_slice(&self.seed.to_le_bytes());
        }
        v.truncate(len);
        v
    }
    fn mkdir(&mut self, p: &str) -> Result<()> {
        self.ops += 1;
        self.t.mkdir(p)?;
        self.model.insert(p.into(), Node::Dir);
        Ok(())
    }
    fn write(&mut self, p: &str, len: usize) -> Result<()> {
        let d = self.data(len);
        self.ops += 1;
        self.bytes_written += len as u64;
        self.t.write_file(p, &d)?;
        self.model.insert(p.into(), Node::File(d));
        Ok(())
    }
    fn file_mut(&mut self, p: &str) -> Result<&mut Vec<u8>> {
        match self.model.get_mut(p) {
            Some(Node::File(v)) => Ok(v),
            _ => bail!("model: {p} is not a file"),
        }
    }
    fn append(&mut self, p: &str, len: usize) -> Result<()> {
        let d = self.data(len);
        self.ops += 1;
        self.bytes_written += len as u64;
        self.t.append(p, &d)?;
        self.file_mut(p)?.extend_from_slice(&d);
        Ok(())
    }
    fn overwrite(&mut self, p: &str, off: usize, len: usize) -> Result<()> {
        let d = self.data(len);
        self.ops += 1;
        self.bytes_written += len as u64;
        self.t.write_at(p, off as u64, &d)?;
        let f = self.file_mut(p)?;
        if f.len() < off + len {
            f.resize(off + len, 0);
        }
        f[off..off + len].copy_from_slice(&d);
        Ok(())
    }
    fn truncate(&mut self, p: &str, len: usize) -> Result<()> {
        self.ops += 1;
        self.t.truncate(p, len as u64)?;
        self.file_mut(p)?.resize(len, 0);
        Ok(())
    }
    fn rename(&mut self, from: &str, to: &str) -> Result<()> {
        self.ops += 1;
        self.t.rename(from, to)?;
        // Move the node and, for a directory, everything below it.
        let moved: Vec<String> = self
            .model
            .keys()
            .filter(|k| *k == from || k.starts_with(&format!("{from}/")))
            .cloned()
            .collect();
        for k in moved {
            if let Some(n) = self.model.remove(&k) {
                self.model.insert(format!("{to}{}", &k[from.len()..]), n);
            }
        }
        Ok(())
    }
    fn link(&mut self, from: &str, to: &str) -> Result<()> {
        self.ops += 1;
        self.t.link(from, to)?;
        let n = self
            .model
            .get(from)
            .cloned()
            .context("model: link source")?;
        self.model.insert(to.into(), n);
        Ok(())
    }
    fn symlink(&mut self, target: &str, p: &str) -> Result<()> {
        self.ops += 1;
        self.t.symlink(target, p)?;
        self.model.insert(p.into(), Node::Symlink(target.into()));
        Ok(())
    }
    fn unlink(&mut self, p: &str) -> Result<()> {
        self.ops += 1;
        self.t.unlink(p)?;
        self.model.remove(p);
        Ok(())
    }
    fn rmdir(&mut self, p: &str) -> Result<()> {
        self.ops += 1;
        self.t.rmdir(p)?;
        self.model.remove(p);
        Ok(())
    }
    fn fsync(&mut self, p: &str) -> Result<()> {
        self.ops += 1;
        self.t.fsync(p)
    }

    /// The scripted workload.
    fn run(&mut self) -> Result<()> {
        // A tree of directories and files of awkward sizes.
        for d in [
            "/docs",
            "/docs/drafts",
            "/src",
            "/src/lib",
            "/src/lib/deep",
            "/tmp",
        ] {
            self.mkdir(d)?;
        }
        let sizes = [0usize, 1, 100, 1023, 1024, 4095, 4096, 4097, 65536, 300_000];
        for (i, s) in sizes.iter().enumerate() {
            let dir = ["/docs", "/docs/drafts", "/src", "/src/lib", "/src/lib/deep"][i % 5];
            self.write(&format!("{dir}/file{i}.dat"), *s)?;
        }
        self.write("/big.bin", 3 << 20)?;
        for i in 0..40 {
            self.write(&format!("/tmp/small{i:02}"), 10 + i * 37)?;
        }
        // Appends, overwrites (inside, across the end), truncation.
        self.write("/docs/log.txt", 0)?;
        for _ in 0..20 {
            self.append("/docs/log.txt", 777)?;
        }
        self.overwrite("/big.bin", 1_000_000, 50_000)?;
        self.overwrite("/big.bin", (3 << 20) - 100, 5000)?;
        self.overwrite("/docs/file0.dat", 10_000, 10)?;
        self.truncate("/docs/drafts/file6.dat", 1000)?;
        self.truncate("/src/lib/file8.dat", 100_000)?;
        // Rename a file, move across directories, rename a directory.
        self.rename("/docs/log.txt", "/docs/journal.txt")?;
        self.rename("/src/file2.dat", "/docs/moved.dat")?;
        self.rename("/src/lib/deep", "/src/deeper")?;
        // Hard links: link, drop the original name, the data stays.
        self.link("/docs/moved.dat", "/src/hardlink.dat")?;
        let n = self.t.nlink("/src/hardlink.dat")?;
        ensure!(n == 2, "hard link count is {n}, expected 2");
        self.unlink("/docs/moved.dat")?;
        let n = self.t.nlink("/src/hardlink.dat")?;
        ensure!(n == 1, "link count after unlink is {n}, expected 1");
        // Symlinks, short (inline) and long (needs a block).
        self.symlink("../docs/journal.txt", "/src/short-link")?;
        let long = format!("/{}", "x".repeat(200));
        self.symlink(&long, "/src/long-link")?;
        // Extended attributes.
        self.ops += 1;
        self.t
            .set_xattr("/docs/journal.txt", "user.demo", b"hello xattr")?;
        self.ops += 1;
        self.t
            .set_xattr("/docs/journal.txt", "user.big", &[7u8; 600])?;
        self.ops += 1;
        let v = self.t.get_xattr("/docs/journal.txt", "user.demo")?;
        ensure!(
            v == b"hello xattr",
            "xattr read back {:?}",
            String::from_utf8_lossy(&v)
        );
        self.ops += 1;
        let mut names = self.t.list_xattr("/docs/journal.txt")?;
        names.sort();
        ensure!(
            names == ["user.big", "user.demo"],
            "listxattr returned {names:?}"
        );
        self.ops += 1;
        self.t.remove_xattr("/docs/journal.txt", "user.big")?;
        self.ops += 1;
        let names = self.t.list_xattr("/docs/journal.txt")?;
        ensure!(names == ["user.demo"], "after removexattr: {names:?}");
        // Unlink, an open-unlinked file, rmdir.
        for i in (0..40).step_by(3) {
            self.unlink(&format!("/tmp/small{i:02}"))?;
        }
        let expect = match self.model.get("/tmp/small01") {
            Some(Node::File(v)) => v.clone(),
            _ => bail!("model: /tmp/small01 missing"),
        };
        self.ops += 3;
        let got = self.t.read_after_unlink("/tmp/small01")?;
        ensure!(got == expect, "open-unlinked file read back wrong data");
        self.model.remove("/tmp/small01");
        self.mkdir("/docs/empty")?;
        self.rmdir("/docs/empty")?;
        // Durability points.
        self.fsync("/big.bin")?;
        self.fsync("/docs/journal.txt")?;
        self.fsync("/docs")?;
        Ok(())
    }

    /// Read everything back and compare with the model, directory listings too.
    fn verify(&mut self) -> Result<usize> {
        let mut checked = 0;
        let entries: Vec<(String, Node)> = self
            .model
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (p, n) in &entries {
            match n {
                Node::File(want) => {
                    let got = self.t.read(p)?;
                    self.bytes_read += got.len() as u64;
                    if &got != want {
                        let first = got.iter().zip(want.iter()).position(|(a, b)| a != b);
                        bail!(
                            "{p}: read back {} bytes, expected {} (first difference at {:?})",
                            got.len(),
                            want.len(),
                            first
                        );
                    }
                }
                Node::Symlink(t) => {
                    let got = self.t.readlink(p)?;
                    ensure!(&got == t, "{p}: symlink reads {got:?}, expected {t:?}");
                }
                Node::Dir => {}
            }
            checked += 1;
        }
        let mut dirs: Vec<String> = vec!["/".into()];
        dirs.extend(
            entries
                .iter()
                .filter(|(_, n)| *n == Node::Dir)
                .map(|(p, _)| p.clone()),
        );
        for d in dirs {
            let mut got = self.t.list(&d)?;
            got.retain(|n| n != "lost+found");
            got.sort();
            let prefix = if d == "/" {
                "/".to_string()
            } else {
                format!("{d}/")
            };
            let mut want: Vec<String> = entries
                .iter()
                .filter_map(|(p, _)| p.strip_prefix(&prefix))
                .filter(|rest| !rest.is_empty() && !rest.contains('/'))
                .map(str::to_string)
                .collect();
            want.sort();
            ensure!(
                got == want,
                "directory {d} lists {got:?}, expected {want:?}"
            );
        }
        Ok(checked)
    }
}

// ------------------------------------------------------------------ the command

/// Cleans up whatever the demo left, also when it fails half way.
struct Cleanup {
    dir: PathBuf,
    created_dir: bool,
    image: PathBuf,
    mnt: PathBuf,
    keep: bool,
    mount: Option<BackgroundMount>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(m) = self.mount.take() {
            if let Err(e) = m.unmount() {
                eprintln!("demo: unmount during cleanup failed: {e}");
            }
        }
        if is_mounted(&self.mnt) {
            let _ = Command::new("fusermount3")
                .arg("-uz")
                .arg(&self.mnt)
                .status();
        }
        if self.keep {
            return;
        }
        let _ = std::fs::remove_file(&self.image);
        let _ = std::fs::remove_dir(&self.mnt);
        if self.created_dir {
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}

/// Whether `dir` is a mount point (per /proc/self/mountinfo).
fn is_mounted(dir: &Path) -> bool {
    let Ok(t) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = dir.to_string_lossy();
    t.lines().any(|l| l.split(' ').nth(4) == Some(&*want))
}

fn fuse_available() -> Result<(), String> {
    if std::env::var_os("COMMITFS_DEMO_NO_FUSE").is_some() {
        return Err("COMMITFS_DEMO_NO_FUSE is set".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Err("/dev/fuse is missing (load the fuse module)".into());
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let have_fusermount = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("fusermount3").exists()))
        .unwrap_or(false);
    if !root && !have_fusermount {
        return Err("fusermount3 is missing (apt-get install fuse3)".into());
    }
    Ok(())
}

fn have_tool(name: &str) -> bool {
    Command::new(name).arg("-V").output().is_ok()
}

/// The e2fsck verdict: clean, or the full output.
fn fsck(image: &Path) -> Result<Result<(), String>> {
    let v = super::fsck::check(image).context("running e2fsck -fn")?;
    if v.is_clean() {
        Ok(Ok(()))
    } else {
        Ok(Err(format!("exit code {}:\n{}", v.code, v.output)))
    }
}

/// `commitfs demo`.
pub fn run(dir: Option<&Path>, keep: bool) -> Result<()> {
    for t in ["mkfs.ext4", "e2fsck"] {
        if !have_tool(t) {
            bail!("{t} not found: install e2fsprogs");
        }
    }
    let (dir, created_dir) = match dir {
        Some(d) => {
            let created = !d.exists();
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            (std::fs::canonicalize(d)?, created)
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
            (d, true)
        }
    };
    let image = dir.join("demo.img");
    let mnt = dir.join("mnt");
    let mut guard = Cleanup {
        dir: dir.clone(),
        created_dir,
        image: image.clone(),
        mnt: mnt.clone(),
        keep,
        mount: None,
    };
    let t0 = Instant::now();
    println!("commitfs demo in {}", dir.display());
    mkfs::make(
        &image,
        &MkfsOptions {
            size: Some(256 << 20),
            // The demo's own scratch image: a kept one is remade on the next run.
            force: true,
            ..Default::default()
        },
    )?;
    println!(
        "  made a 256 MiB ext4 image with mkfs.ext4: {}",
        image.display()
    );

    let fs = Arc::new(
        Fs::open_path(&image, MountOptions::default())
            .map_err(|e| anyhow!("opening {}: {e}", image.display()))?,
    );
    let mode;
    let (checked, ops, written, read) = match fuse_available() {
        Ok(()) => {
            std::fs::create_dir_all(&mnt)?;
            let cfg = FuseConfig {
                fsname: image.display().to_string(),
                ..FuseConfig::default()
            };
            let session = commitfs_fuse::mount(fs.clone(), &mnt, &cfg)
                .map_err(|e| anyhow!("FUSE mount at {} failed: {e}", mnt.display()))?;
            guard.mount = Some(session.spawn()?);
            mode = "FUSE";
            println!("  mounted with FUSE at {}", mnt.display());
            let mut t = Posix { root: mnt.clone() };
            let r = run_workload(&mut t);
            let m = guard.mount.take().context("mount vanished")?;
            let u = m.unmount();
            let r = r?;
            u.map_err(|e| anyhow!("{e}"))?;
            println!("  unmounted");
            r
        }
        Err(why) => {
            mode = "library";
            println!(
                "  NOTE: FUSE unavailable ({why}); running the workload through the library API"
            );
            let mut t = Lib { fs: fs.clone() };
            let r = run_workload(&mut t)?;
            fs.unmount().map_err(|e| anyhow!("unmount: {e}"))?;
            r
        }
    };
    let stats: StatsSnapshot = fs.io_stats();
    drop(fs);
    println!("  workload ({mode}): {ops} operations, {} written, {} read back and verified ({checked} paths)", human(written), human(read));
    println!(
        "  device: {} writes ({}), {} flushes; data {} writes, metadata {} writes, journal {} writes",
        stats.total_writes(),
        human(stats.total_write_bytes()),
        stats.flushes,
        stats.data.writes,
        stats.metadata.writes,
        stats.journal.writes
    );
    let verdict = fsck(&image)?;
    match &verdict {
        Ok(()) => println!("  e2fsck -fn: clean"),
        Err(out) => println!("  e2fsck -fn: PROBLEMS\n{out}"),
    }
    println!("  time: {:.2} s", t0.elapsed().as_secs_f64());
    if keep {
        println!("  kept {}", image.display());
    }
    drop(guard);
    match verdict {
        Ok(()) => {
            println!("demo: PASS");
            Ok(())
        }
        Err(_) => bail!("e2fsck -fn found problems in the image"),
    }
}

/// Run and verify; returns (paths checked, operations, bytes written, bytes read).
fn run_workload(t: &mut dyn Target) -> Result<(usize, u64, u64, u64)> {
    let mut w = Workload {
        t,
        model: BTreeMap::new(),
        ops: 0,
        bytes_written: 0,
        bytes_read: 0,
        seed: 0x9E37_79B9_7F4A_7C15,
    };
    w.model.insert("/".into(), Node::Dir);
    w.run().context("workload")?;
    w.model.remove("/");
    let checked = w.verify().context("verification")?;
    Ok((checked, w.ops, w.bytes_written, w.bytes_read))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_paths() {
        assert_eq!(Lib::split("/a/b"), ("/a", "b"));
        assert_eq!(Lib::split("/a"), ("", "a"));
        assert_eq!(Lib::split("/a/b/"), ("/a", "b"));
    }
}
