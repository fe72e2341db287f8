//! Reading a whole tree back from a mounted commitfs through the library API.

use std::collections::{BTreeMap, HashSet};

use commitfs_fs::{FileType, Fs, Ino, ROOT_INO};

use crate::model::{canonical, join, Canonical, Kind, Meta};

/// A tree as the file system shows it: paths to inode numbers, and per inode its
/// metadata and (regular files) content.
#[derive(Debug, Default)]
pub struct Observed {
    pub paths: BTreeMap<String, Ino>,
    pub inodes: BTreeMap<Ino, (Meta, Vec<u8>)>,
}

impl Observed {
    pub fn canonical(&self) -> Canonical<'_> {
        canonical(&self.paths, |ino| &self.inodes[&ino].0)
    }
    pub fn content(&self, path: &str) -> Option<&[u8]> {
        Some(&self.inodes.get(self.paths.get(path)?)?.1)
    }
}

/// Names the harness never touches (they exist on every fresh image).
pub const IGNORED: &[&str] = &["/lost+found"];

/// Walk the tree from the root. Any error, a directory reached twice, a duplicate
/// name, or a directory entry whose type disagrees with its inode is reported.
pub fn observe(fs: &Fs, max_file_size: u64) -> Result<Observed, String> {
    let mut out = Observed::default();
    let mut seen_dirs = HashSet::new();
    let root = meta_of(fs, ROOT_INO, "/")?;
    out.paths.insert("/".into(), ROOT_INO);
    out.inodes.insert(ROOT_INO, (root, Vec::new()));
    let mut stack = vec![(ROOT_INO, "/".to_string())];
    seen_dirs.insert(ROOT_INO);
    while let Some((dir, path)) = stack.pop() {
        let entries = fs
            .readdir_all(dir)
            .map_err(|e| format!("readdir {path}: {e}"))?;
        let mut names = HashSet::new();
        for e in entries {
            if e.name == b"." || e.name == b".." {
                continue;
            }
            let name = String::from_utf8_lossy(&e.name).into_owned();
            let p = join(&path, &name);
            if IGNORED.contains(&p.as_str()) {
                continue;
            }
            if !names.insert(e.name.clone()) {
                return Err(format!("duplicate directory entry {p}"));
            }
            let meta = match out.inodes.get(&e.ino) {
                Some((m, _)) => m.clone(),
                None => meta_of(fs, e.ino, &p)?,
            };
            let want = match e.kind {
                FileType::Regular => Kind::File,
                FileType::Directory => Kind::Dir,
                FileType::Symlink => Kind::Symlink,
                k => return Err(format!("{p}: unexpected file type {k:?}")),
            };
            if want != meta.kind {
                return Err(format!(
                    "{p}: directory entry says {want:?}, inode {} is {:?}",
                    e.ino, meta.kind
                ));
            }
            if meta.kind == Kind::Dir {
                if !seen_dirs.insert(e.ino) {
                    return Err(format!("directory inode {} reached twice ({p})", e.ino));
                }
                stack.push((e.ino, p.clone()));
            }
            if let std::collections::btree_map::Entry::Vacant(v) = out.inodes.entry(e.ino) {
                let content = if meta.kind == Kind::File {
                    if meta.size > max_file_size {
                        return Err(format!("{p}: size {} is impossible", meta.size));
                    }
                    let mut buf = vec![0u8; meta.size as usize];
                    let n = fs
                        .read(e.ino, 0, &mut buf)
                        .map_err(|err| format!("read {p}: {err}"))?;
                    if n != buf.len() {
                        return Err(format!("read {p}: {n} of {} bytes", buf.len()));
                    }
                    buf
                } else {
                    Vec::new()
                };
                v.insert((meta, content));
            }
            out.paths.insert(p, e.ino);
        }
    }
    Ok(out)
}

fn meta_of(fs: &Fs, ino: Ino, path: &str) -> Result<Meta, String> {
    let a = fs
        .getattr(ino)
        .map_err(|e| format!("getattr {path} (inode {ino}): {e}"))?;
    let kind = match a.kind {
        FileType::Regular => Kind::File,
        FileType::Directory => Kind::Dir,
        FileType::Symlink => Kind::Symlink,
        k => return Err(format!("{path}: unexpected file type {k:?}")),
    };
    let target = if kind == Kind::Symlink {
        fs.readlink(ino)
            .map_err(|e| format!("readlink {path}: {e}"))?
    } else {
        Vec::new()
    };
    let mut xattrs = BTreeMap::new();
    for name in fs
        .listxattr(ino)
        .map_err(|e| format!("listxattr {path}: {e}"))?
    {
        let v = fs
            .getxattr(ino, &name)
            .map_err(|e| format!("getxattr {path} {}: {e}", String::from_utf8_lossy(&name)))?;
        xattrs.insert(name, v);
    }
    Ok(Meta {
        kind,
        perm: a.perm,
        nlink: a.nlink,
        size: if kind == Kind::Dir { 0 } else { a.size },
        target,
        xattrs,
    })
}

/// A readable difference between two canonical trees (for failure messages).
pub fn diff(expected: &Canonical<'_>, got: &Canonical<'_>) -> String {
    let e: BTreeMap<&str, (&Meta, usize)> =
        expected.iter().map(|(p, m, g)| (*p, (*m, *g))).collect();
    let g: BTreeMap<&str, (&Meta, usize)> = got.iter().map(|(p, m, g)| (*p, (*m, *g))).collect();
    let mut out = Vec::new();
    for (p, (m, _)) in &e {
        match g.get(p) {
            None => out.push(format!("missing {p} ({:?})", m.kind)),
            Some((gm, _)) if gm != m => out.push(format!("differs {p}: {}", meta_diff(m, gm))),
            _ => {}
        }
    }
    for (p, (m, _)) in &g {
        if !e.contains_key(p) {
            out.push(format!("unexpected {p} ({:?}, size {})", m.kind, m.size));
        }
    }
    if out.is_empty() {
        out.push("hard-link structure differs".into());
    }
    let n = out.len();
    out.truncate(12);
    if n > 12 {
        out.push(format!("... {} more", n - 12));
    }
    out.join("; ")
}

fn meta_diff(want: &Meta, got: &Meta) -> String {
    let mut v = Vec::new();
    if want.kind != got.kind {
        v.push(format!("kind {:?} != {:?}", got.kind, want.kind));
    }
    if want.perm != got.perm {
        v.push(format!("perm {:o} != {:o}", got.perm, want.perm));
    }
    if want.nlink != got.nlink {
        v.push(format!("nlink {} != {}", got.nlink, want.nlink));
    }
    if want.size != got.size {
        v.push(format!("size {} != {}", got.size, want.size));
    }
    if want.target != got.target {
        v.push("symlink target".into());
    }
    if want.xattrs != got.xattrs {
        let names = |m: &Meta| {
            m.xattrs
                .keys()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .collect::<Vec<_>>()
        };
        v.push(format!("xattrs {:?} != {:?}", names(got), names(want)));
    }
    v.join(", ")
}
