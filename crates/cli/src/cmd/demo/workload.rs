//! The demo's workload: a mail server's delivery loop (create a message file,
//! write 4-16 KiB, fsync it; now and then mark an older message read with a
//! rename, or delete one), served through a mount (plain system calls) or the
//! library directly, plus the check that a tree is what the workload left,
//! exactly, or after a power cut during a given fsync.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{anyhow, bail, ensure, Context, Result};
use commitfs_fs::{Fs, FsError, Ino, RenameFlags};

/// The operations the workload needs.
pub trait Target {
    fn mkdir(&mut self, p: &str) -> Result<()>;
    /// Create `p`, write `data`, fsync, close.
    fn create_fsync(&mut self, p: &str, data: &[u8]) -> Result<()>;
    fn fsync_dir(&mut self, p: &str) -> Result<()>;
    fn rename(&mut self, from: &str, to: &str) -> Result<()>;
    fn unlink(&mut self, p: &str) -> Result<()>;
    fn read(&mut self, p: &str) -> Result<Vec<u8>>;
    /// Names in a directory, without "." and "..".
    fn list(&mut self, p: &str) -> Result<Vec<String>>;
}

/// A mounted tree (FUSE or kernel ext4).
pub struct Posix {
    pub root: PathBuf,
}

impl Posix {
    fn p(&self, p: &str) -> PathBuf {
        self.root.join(p.trim_start_matches('/'))
    }
}

impl Target for Posix {
    fn mkdir(&mut self, p: &str) -> Result<()> {
        std::fs::create_dir(self.p(p)).with_context(|| format!("mkdir {p}"))
    }
    fn create_fsync(&mut self, p: &str, data: &[u8]) -> Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(self.p(p))
            .with_context(|| format!("create {p}"))?;
        f.write_all(data).with_context(|| format!("write {p}"))?;
        f.sync_all().with_context(|| format!("fsync {p}"))
    }
    fn fsync_dir(&mut self, p: &str) -> Result<()> {
        let f = std::fs::File::open(self.p(p)).with_context(|| format!("open {p}"))?;
        f.sync_all().with_context(|| format!("fsync {p}"))
    }
    fn rename(&mut self, from: &str, to: &str) -> Result<()> {
        std::fs::rename(self.p(from), self.p(to)).with_context(|| format!("rename {from} {to}"))
    }
    fn unlink(&mut self, p: &str) -> Result<()> {
        std::fs::remove_file(self.p(p)).with_context(|| format!("unlink {p}"))
    }
    fn read(&mut self, p: &str) -> Result<Vec<u8>> {
        std::fs::read(self.p(p)).with_context(|| format!("read {p}"))
    }
    fn list(&mut self, p: &str) -> Result<Vec<String>> {
        let mut v = Vec::new();
        for e in std::fs::read_dir(self.p(p)).with_context(|| format!("readdir {p}"))? {
            v.push(e?.file_name().to_string_lossy().into_owned());
        }
        Ok(v)
    }
}

/// The library API, when FUSE is unavailable.
pub struct Lib {
    pub fs: Arc<Fs>,
}

fn lib_err(what: &str, p: &str, e: FsError) -> anyhow::Error {
    anyhow!("{what} {p}: {e}")
}

impl Lib {
    fn ino(&self, p: &str) -> Result<Ino> {
        self.fs.resolve(p).map_err(|e| lib_err("resolve", p, e))
    }
    /// Parent inode and last component of `p`.
    fn parent<'a>(&self, p: &'a str) -> Result<(Ino, &'a str)> {
        let p = p.trim_end_matches('/');
        let (d, n) = p.rsplit_once('/').unwrap_or(("", p));
        Ok((self.ino(d)?, n))
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
    fn create_fsync(&mut self, p: &str, data: &[u8]) -> Result<()> {
        let (d, n) = self.parent(p)?;
        let ino = self
            .fs
            .create(d, n.as_bytes(), 0o644, 0, 0)
            .map_err(|e| lib_err("create", p, e))?
            .ino;
        self.fs.open_inode(ino).map_err(|e| lib_err("open", p, e))?;
        let r = (|| {
            let mut off = 0;
            while off < data.len() {
                let w = self
                    .fs
                    .write(ino, off as u64, &data[off..])
                    .map_err(|e| lib_err("write", p, e))?;
                ensure!(w > 0, "write {p}: wrote nothing");
                off += w;
            }
            self.fs
                .fsync(ino, false)
                .map_err(|e| lib_err("fsync", p, e))
        })();
        self.fs.release(ino).map_err(|e| lib_err("close", p, e))?;
        r
    }
    fn fsync_dir(&mut self, p: &str) -> Result<()> {
        let ino = self.ino(p)?;
        self.fs.fsyncdir(ino).map_err(|e| lib_err("fsync", p, e))
    }
    fn rename(&mut self, from: &str, to: &str) -> Result<()> {
        let (a, an) = self.parent(from)?;
        let (b, bn) = self.parent(to)?;
        self.fs
            .rename(a, an.as_bytes(), b, bn.as_bytes(), RenameFlags::default())
            .map_err(|e| lib_err("rename", from, e))
    }
    fn unlink(&mut self, p: &str) -> Result<()> {
        let (d, n) = self.parent(p)?;
        self.fs
            .unlink(d, n.as_bytes())
            .map_err(|e| lib_err("unlink", p, e))
    }
    fn read(&mut self, p: &str) -> Result<Vec<u8>> {
        let ino = self.ino(p)?;
        let size = self
            .fs
            .getattr(ino)
            .map_err(|e| lib_err("stat", p, e))?
            .size;
        let mut v = vec![0u8; size as usize];
        let mut off = 0;
        while off < v.len() {
            let n = self
                .fs
                .read(ino, off as u64, &mut v[off..])
                .map_err(|e| lib_err("read", p, e))?;
            ensure!(n > 0, "read {p}: short read at {off} of {size}");
            off += n;
        }
        Ok(v)
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
}

/// The two mail folders (maildir's `new` and `cur`).
pub const DIRS: [&str; 2] = ["new", "cur"];

/// One delivered message and what happened to it afterwards.
#[derive(Debug, Clone)]
struct Msg {
    name: String,
    data: Vec<u8>,
    /// Marked read (moved `new/` -> `cur/`) after this many fsyncs had returned.
    read_after: Option<usize>,
    /// Deleted after this many fsyncs had returned.
    deleted_after: Option<usize>,
}

/// The mail workload and its record of what it did.
pub struct Mail {
    seed: u64,
    msgs: Vec<Msg>,
}

/// Device position (e.g. requests logged so far) before and after fsync `i`.
pub type Marks = Vec<(u64, u64)>;

/// A small deterministic generator (SplitMix64).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Mail {
    pub fn new(seed: u64) -> Mail {
        Mail {
            seed,
            msgs: Vec::new(),
        }
    }

    /// Message `i`: 4-16 KiB of content that no other message has.
    fn message(&self, i: usize) -> Vec<u8> {
        let mut s = mix(self.seed ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
        let len = 4096 + (s % 12289) as usize;
        let mut v = Vec::with_capacity(len + 8);
        while v.len() < len {
            s = mix(s);
            v.extend_from_slice(&s.to_le_bytes());
        }
        v.truncate(len);
        v
    }

    /// Make the folders and make them durable (before any measurement).
    pub fn setup(&mut self, t: &mut dyn Target) -> Result<()> {
        for d in DIRS {
            t.mkdir(&format!("/{d}"))?;
        }
        t.fsync_dir("/")
    }

    /// Deliver `n` messages (one fsync each). `probe` gives the device position;
    /// it is sampled around each delivery into the returned marks. `tick` runs
    /// after each fsync returned (progress; an error stops the run).
    pub fn run(
        &mut self,
        t: &mut dyn Target,
        n: usize,
        probe: &dyn Fn() -> u64,
        tick: &dyn Fn() -> Result<()>,
    ) -> Result<Marks> {
        let mut marks = Vec::with_capacity(n);
        for i in 0..n {
            let data = self.message(i);
            let name = format!("m{i:05}");
            let before = probe();
            t.create_fsync(&format!("/new/{name}"), &data)?;
            marks.push((before, probe()));
            tick()?;
            self.msgs.push(Msg {
                name,
                data,
                read_after: None,
                deleted_after: None,
            });
            let done = i + 1;
            // Read the previous message: new/ -> cur/.
            if i % 3 == 2 {
                let m = &mut self.msgs[i - 1];
                t.rename(&format!("/new/{}", m.name), &format!("/cur/{}", m.name))?;
                m.read_after = Some(done);
            }
            // Delete the oldest read message.
            if i % 4 == 3 {
                if let Some(m) = self
                    .msgs
                    .iter_mut()
                    .find(|m| m.read_after.is_some() && m.deleted_after.is_none())
                {
                    t.unlink(&format!("/cur/{}", m.name))?;
                    m.deleted_after = Some(done);
                }
            }
        }
        Ok(marks)
    }

    /// Messages delivered and messages still there at the end.
    #[cfg(test)]
    pub fn counts(&self) -> (usize, usize) {
        let live = self
            .msgs
            .iter()
            .filter(|m| m.deleted_after.is_none())
            .count();
        (self.msgs.len(), live)
    }

    /// Check `tree` (from [`read_tree`]). `cut: None`: everything the workload did
    /// must be there exactly. `cut: Some(c)`: the power failed during fsync `c`
    /// (1-based), so fsyncs `1..c` had returned: every message fsynced then is
    /// there with its exact content (under its old or new name if it was renamed
    /// before the cut, or gone if it was deleted before the cut); message `c` is
    /// absent, empty or complete; nothing else exists.
    pub fn check(&self, tree: &BTreeMap<String, Vec<u8>>, cut: Option<usize>) -> Result<Verdict> {
        let mut v = Verdict::default();
        let mut seen = 0usize;
        let limit = cut.unwrap_or(usize::MAX);
        for (i, m) in self.msgs.iter().enumerate() {
            let fsync_no = i + 1;
            if fsync_no > limit {
                break;
            }
            let before_cut = |a: Option<usize>| a.is_some_and(|d| d < limit);
            let (moved, deleted) = (before_cut(m.read_after), before_cut(m.deleted_after));
            let new = format!("/new/{}", m.name);
            let cur = format!("/cur/{}", m.name);
            let found: Vec<(&String, &Vec<u8>)> = [&new, &cur]
                .into_iter()
                .filter_map(|p| tree.get(p).map(|d| (p, d)))
                .collect();
            seen += found.len();
            ensure!(
                found.len() <= 1,
                "message {} is in both new/ and cur/",
                m.name
            );
            let exact = found.first().is_some_and(|(_, d)| **d == m.data);
            if let Some((p, d)) = found.first() {
                let empty_ok = fsync_no == limit && d.is_empty();
                ensure!(
                    exact || empty_ok,
                    "{p}: {} bytes that are not the message's {} bytes",
                    d.len(),
                    m.data.len()
                );
            }
            let at = |p: &String| found.first().is_some_and(|(q, _)| *q == p);
            if cut.is_none() {
                let want = if deleted {
                    None
                } else if moved {
                    Some(&cur)
                } else {
                    Some(&new)
                };
                match want {
                    None => ensure!(found.is_empty(), "deleted message {} is there", m.name),
                    Some(w) => ensure!(at(w) && exact, "{w} is missing or wrong"),
                }
                if !deleted {
                    v.intact += 1;
                }
                continue;
            }
            if fsync_no == limit {
                v.in_flight = Some(if found.is_empty() {
                    "absent"
                } else if exact {
                    "complete"
                } else {
                    "empty"
                });
                continue;
            }
            if deleted {
                if found.is_empty() {
                    v.deleted_gone += 1;
                } else {
                    v.deleted_kept += 1;
                }
                continue;
            }
            ensure!(
                !found.is_empty(),
                "message {} (fsync #{fsync_no} returned before the cut) is missing",
                m.name
            );
            v.intact += 1;
            if moved {
                if at(&cur) {
                    v.renamed_new += 1;
                } else {
                    v.renamed_old += 1;
                }
            } else {
                ensure!(at(&new), "message {} was never moved", m.name);
            }
        }
        if seen != tree.len() {
            let extra: Vec<&String> = tree
                .keys()
                .filter(|p| {
                    !self
                        .msgs
                        .iter()
                        .any(|m| p.ends_with(&format!("/{}", m.name)))
                })
                .take(5)
                .collect();
            bail!(
                "{} files in the tree, {seen} accounted for; unexpected: {extra:?}",
                tree.len()
            );
        }
        Ok(v)
    }
}

/// What [`Mail::check`] found.
#[derive(Debug, Default, Clone)]
pub struct Verdict {
    /// Messages that had to be there and are, with their exact content.
    pub intact: usize,
    /// Of those, renamed before the cut: found under the new / the old name.
    pub renamed_new: usize,
    pub renamed_old: usize,
    /// Deleted before the cut (not fsynced since): gone / still there (intact).
    pub deleted_gone: usize,
    pub deleted_kept: usize,
    /// The message whose fsync the power cut interrupted.
    pub in_flight: Option<&'static str>,
}

/// Every file of the mail folders with its content; anything else in the root
/// but `lost+found` is an error.
pub fn read_tree(t: &mut dyn Target) -> Result<BTreeMap<String, Vec<u8>>> {
    let mut tree = BTreeMap::new();
    let mut root = t.list("/")?;
    root.sort();
    let want: Vec<String> = std::iter::once("lost+found")
        .chain(DIRS)
        .map(String::from)
        .collect();
    let mut want_sorted = want.clone();
    want_sorted.sort();
    ensure!(
        root == want_sorted,
        "the root holds {root:?}, expected {want_sorted:?}"
    );
    for d in DIRS {
        for n in t.list(&format!("/{d}"))? {
            let p = format!("/{d}/{n}");
            let data = t.read(&p)?;
            tree.insert(p, data);
        }
    }
    Ok(tree)
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::cell::RefCell;
    use std::rc::Rc;

    type Tree = BTreeMap<String, Vec<u8>>;

    /// An in-memory target, to test the checker.
    #[derive(Default)]
    struct Mem(Rc<RefCell<Tree>>);
    impl Target for Mem {
        fn mkdir(&mut self, _: &str) -> Result<()> {
            Ok(())
        }
        fn create_fsync(&mut self, p: &str, d: &[u8]) -> Result<()> {
            self.0.borrow_mut().insert(p.into(), d.to_vec());
            Ok(())
        }
        fn fsync_dir(&mut self, _: &str) -> Result<()> {
            Ok(())
        }
        fn rename(&mut self, a: &str, b: &str) -> Result<()> {
            let mut t = self.0.borrow_mut();
            let d = t.remove(a).context("rename source")?;
            t.insert(b.into(), d);
            Ok(())
        }
        fn unlink(&mut self, p: &str) -> Result<()> {
            self.0.borrow_mut().remove(p).map(|_| ()).context("unlink")
        }
        fn read(&mut self, p: &str) -> Result<Vec<u8>> {
            self.0.borrow().get(p).cloned().context("read")
        }
        fn list(&mut self, _: &str) -> Result<Vec<String>> {
            unreachable!()
        }
    }

    #[test]
    fn checker_accepts_the_truth_and_catches_losses() {
        let mut mail = Mail::new(7);
        let mut t = Mem::default();
        let live = t.0.clone();
        // The tree right after each fsync returned (before that round's rename or
        // delete): what a power cut during the next fsync may leave at best.
        let snaps: RefCell<Vec<Tree>> = RefCell::default();
        mail.run(&mut t, 40, &|| 0, &|| {
            snaps.borrow_mut().push(live.borrow().clone());
            Ok(())
        })
        .unwrap();
        let (delivered, left) = mail.counts();
        assert_eq!(delivered, 40);
        let end = live.borrow().clone();
        assert_eq!(left, end.len());
        let v = mail.check(&end, None).unwrap();
        assert_eq!(v.intact, left);
        // The end state is a legal outcome of a cut during a 41st fsync.
        assert_eq!(mail.check(&end, Some(41)).unwrap().intact, left);
        // A cut during fsync 30: the state after fsync 30 (message 29 complete) or
        // after fsync 29 (message 29 absent) are both fine.
        let snaps = snaps.into_inner();
        let after30 = &snaps[29];
        let v = mail.check(after30, Some(30)).unwrap();
        assert_eq!(v.in_flight, Some("complete"));
        assert!(
            v.intact > 0 && v.renamed_new > 0 && v.deleted_gone > 0,
            "{v:?}"
        );
        let v = mail.check(&snaps[28], Some(30)).unwrap();
        assert_eq!(v.in_flight, Some("absent"));
        let mut empty = after30.clone();
        *empty.get_mut("/new/m00029").unwrap() = Vec::new();
        assert_eq!(
            mail.check(&empty, Some(30)).unwrap().in_flight,
            Some("empty")
        );
        // A lost fsynced message, a changed byte, a half-written in-flight message,
        // a stray file, a message under both names: all caught.
        let mut lost = after30.clone();
        lost.remove("/new/m00027");
        assert!(mail.check(&lost, Some(30)).is_err());
        let mut bad = after30.clone();
        bad.get_mut("/new/m00027").unwrap()[100] ^= 1;
        assert!(mail.check(&bad, Some(30)).is_err());
        let mut half = after30.clone();
        half.get_mut("/new/m00029").unwrap().truncate(4096);
        assert!(mail.check(&half, Some(30)).is_err());
        let mut stray = after30.clone();
        stray.insert("/new/x".into(), vec![]);
        assert!(mail.check(&stray, Some(30)).is_err());
        let (p, d) = after30
            .iter()
            .find(|(p, _)| p.starts_with("/cur/"))
            .map(|(p, d)| (p.clone(), d.clone()))
            .expect("a read message");
        let mut both = after30.clone();
        both.insert(p.replace("/cur/", "/new/"), d);
        assert!(mail.check(&both, Some(30)).is_err());
        // Checked against a later cut, the early state has lost fsynced messages.
        assert!(mail.check(&snaps[20], Some(30)).is_err());
    }
}
