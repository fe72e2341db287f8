//! The file operations our built-in workloads issue, over two back ends: POSIX
//! calls on a mounted directory (every system), and the commitfs library
//! (`Fs`) directly, for the separate pass that reads commitfs's own journal
//! breakdown (`Fs::stats`) on the same device.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Mutex;

use commitfs_fs::{Fs, ROOT_INO};

/// An open file of either back end.
pub enum Fh {
    Posix(File),
    Lib { ino: u32, size: u64 },
}

/// Paths are relative to the file system's root, `/`-separated.
pub trait Api: Sync {
    fn mkdir(&self, rel: &str) -> io::Result<()>;
    /// Create (or truncate) and open for writing.
    fn create(&self, rel: &str) -> io::Result<Fh>;
    /// Open an existing file for reading, and appending if `write`.
    fn open(&self, rel: &str, write: bool) -> io::Result<Fh>;
    fn append(&self, f: &mut Fh, data: &[u8]) -> io::Result<()>;
    /// Read the whole file; returns the bytes read.
    fn read_all(&self, f: &mut Fh, buf: &mut [u8]) -> io::Result<u64>;
    fn fsync(&self, f: &mut Fh) -> io::Result<()>;
    fn close(&self, f: Fh) -> io::Result<()>;
    fn unlink(&self, rel: &str) -> io::Result<()>;
    fn fsync_dir(&self, rel: &str) -> io::Result<()>;
    /// Make everything durable (between measurements).
    fn sync(&self) -> io::Result<()>;
}

/// POSIX calls under a mount point.
pub struct Posix {
    pub root: PathBuf,
}

impl Api for Posix {
    fn mkdir(&self, rel: &str) -> io::Result<()> {
        std::fs::create_dir(self.root.join(rel))
    }
    fn create(&self, rel: &str) -> io::Result<Fh> {
        let f = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .mode(0o644)
            .open(self.root.join(rel))?;
        Ok(Fh::Posix(f))
    }
    fn open(&self, rel: &str, write: bool) -> io::Result<Fh> {
        let mut o = OpenOptions::new();
        o.read(true);
        if write {
            o.append(true);
        }
        Ok(Fh::Posix(o.open(self.root.join(rel))?))
    }
    fn append(&self, f: &mut Fh, data: &[u8]) -> io::Result<()> {
        match f {
            Fh::Posix(f) => f.write_all(data),
            Fh::Lib { .. } => Err(io::Error::other("library handle on POSIX back end")),
        }
    }
    fn read_all(&self, f: &mut Fh, buf: &mut [u8]) -> io::Result<u64> {
        let Fh::Posix(f) = f else {
            return Err(io::Error::other("library handle on POSIX back end"));
        };
        let mut total = 0u64;
        loop {
            let n = f.read(buf)?;
            if n == 0 {
                return Ok(total);
            }
            total += n as u64;
        }
    }
    fn fsync(&self, f: &mut Fh) -> io::Result<()> {
        match f {
            Fh::Posix(f) => f.sync_all(),
            Fh::Lib { .. } => Err(io::Error::other("library handle on POSIX back end")),
        }
    }
    fn close(&self, f: Fh) -> io::Result<()> {
        drop(f);
        Ok(())
    }
    fn unlink(&self, rel: &str) -> io::Result<()> {
        std::fs::remove_file(self.root.join(rel))
    }
    fn fsync_dir(&self, rel: &str) -> io::Result<()> {
        File::open(self.root.join(rel))?.sync_all()
    }
    fn sync(&self) -> io::Result<()> {
        // syncfs(2) on the mount.
        let f = File::open(&self.root)?;
        use std::os::fd::AsRawFd;
        // SAFETY: syncfs on a valid descriptor.
        if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// The commitfs library on the device, no FUSE.
pub struct Lib<'a> {
    pub fs: &'a Fs,
    dirs: Mutex<HashMap<String, u32>>,
}

fn err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

impl<'a> Lib<'a> {
    pub fn new(fs: &'a Fs) -> Lib<'a> {
        let mut m = HashMap::new();
        m.insert(String::new(), ROOT_INO);
        Lib {
            fs,
            dirs: Mutex::new(m),
        }
    }

    fn dir_ino(&self, dir: &str) -> io::Result<u32> {
        if let Some(i) = self.dirs.lock().unwrap_or_else(|e| e.into_inner()).get(dir) {
            return Ok(*i);
        }
        let ino = self.fs.resolve(&format!("/{dir}")).map_err(err)?;
        self.dirs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(dir.to_string(), ino);
        Ok(ino)
    }

    fn split<'p>(&self, rel: &'p str) -> io::Result<(u32, &'p str)> {
        let (d, n) = rel.rsplit_once('/').unwrap_or(("", rel));
        Ok((self.dir_ino(d)?, n))
    }
}

impl Api for Lib<'_> {
    fn mkdir(&self, rel: &str) -> io::Result<()> {
        let (p, n) = self.split(rel)?;
        let a = self.fs.mkdir(p, n.as_bytes(), 0o755, 0, 0).map_err(err)?;
        self.dirs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(rel.to_string(), a.ino);
        Ok(())
    }
    fn create(&self, rel: &str) -> io::Result<Fh> {
        let (p, n) = self.split(rel)?;
        let a = match self.fs.create(p, n.as_bytes(), 0o644, 0, 0) {
            Ok(a) => a,
            Err(_) => {
                // Exists: truncate it, like O_TRUNC.
                let a = self.fs.lookup(p, n.as_bytes()).map_err(err)?;
                self.fs
                    .setattr(
                        a.ino,
                        &commitfs_fs::SetAttr {
                            size: Some(0),
                            ..Default::default()
                        },
                    )
                    .map_err(err)?;
                a
            }
        };
        self.fs.open_inode(a.ino).map_err(err)?;
        Ok(Fh::Lib {
            ino: a.ino,
            size: 0,
        })
    }
    fn open(&self, rel: &str, _write: bool) -> io::Result<Fh> {
        let (p, n) = self.split(rel)?;
        let a = self.fs.lookup(p, n.as_bytes()).map_err(err)?;
        self.fs.open_inode(a.ino).map_err(err)?;
        Ok(Fh::Lib {
            ino: a.ino,
            size: a.size,
        })
    }
    fn append(&self, f: &mut Fh, data: &[u8]) -> io::Result<()> {
        let Fh::Lib { ino, size } = f else {
            return Err(io::Error::other("POSIX handle on library back end"));
        };
        let n = self.fs.write(*ino, *size, data).map_err(err)?;
        *size += n as u64;
        Ok(())
    }
    fn read_all(&self, f: &mut Fh, buf: &mut [u8]) -> io::Result<u64> {
        let Fh::Lib { ino, .. } = f else {
            return Err(io::Error::other("POSIX handle on library back end"));
        };
        let mut off = 0u64;
        loop {
            let n = self.fs.read(*ino, off, buf).map_err(err)?;
            if n == 0 {
                return Ok(off);
            }
            off += n as u64;
        }
    }
    fn fsync(&self, f: &mut Fh) -> io::Result<()> {
        let Fh::Lib { ino, .. } = f else {
            return Err(io::Error::other("POSIX handle on library back end"));
        };
        self.fs.fsync(*ino, false).map_err(err)
    }
    fn close(&self, f: Fh) -> io::Result<()> {
        if let Fh::Lib { ino, .. } = f {
            self.fs.release(ino).map_err(err)?;
        }
        Ok(())
    }
    fn unlink(&self, rel: &str) -> io::Result<()> {
        let (p, n) = self.split(rel)?;
        self.fs.unlink(p, n.as_bytes()).map_err(err)
    }
    fn fsync_dir(&self, rel: &str) -> io::Result<()> {
        let d = self.dir_ino(rel)?;
        self.fs.fsyncdir(d).map_err(err)
    }
    fn sync(&self) -> io::Result<()> {
        self.fs.sync().map_err(err)
    }
}
