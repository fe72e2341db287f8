//! The inode table component (issue #10, design C.1 `InodeTable`): cached
//! decoded inodes, open counts, the open-unlinked set and lazytime atimes, moved
//! out of `Inner` with their own lock.
//!
//! First step of the `Inner` split (migration step 7): callers still hold
//! `Inner` around most uses, so the lock is nested inside it for now (rank:
//! after `Inner` and the inode locks, like C.4's `SbState`). It is held only for
//! map operations, never across device I/O, a journal call or another lock, so
//! paths that leave `Inner` later (getattr on a cached inode, open counts) can
//! use it alone. Methods copy out; no guard escapes.

use std::collections::{HashMap, HashSet};

use commitfs_format::inode::Inode;
use parking_lot::Mutex;

/// Cached inodes kept at most until [`InodeTable::set_budget`] says otherwise.
const DEFAULT_CAP: usize = 1 << 20;

/// A cached inode and its second-chance bit (set by every use, cleared by an
/// eviction sweep that spares it once).
struct Entry {
    inode: Inode,
    used: bool,
}

struct State {
    /// Cached decoded inodes. Only a cache: every inode here is also in its
    /// inode-table buffer, except a pending lazytime atime (`lazy`), which
    /// eviction keeps.
    inodes: HashMap<u32, Entry>,
    /// Inodes cached at most; a sweep brings the cache down to 3/4 of it.
    cap: usize,
    /// Inodes dropped by sweeps (`commitfs stats`).
    evicted: u64,
    /// Open file handles per inode (open-unlinked files stay until the last close).
    open: HashMap<u32, u32>,
    /// Inodes with no links left that are still open; freed at the last close.
    unlinked_open: HashSet<u32>,
    /// Inodes whose cached copy carries an atime the inode table does not
    /// have yet (a read's, `atime.rs`; under `lazytime` also kept past
    /// commits) -> coarse seconds when that started.
    lazy: HashMap<u32, u64>,
    /// Oldest value in `lazy` (a cheap expiry check per access).
    lazy_oldest: Option<u64>,
}

impl Default for State {
    fn default() -> Self {
        State {
            inodes: HashMap::new(),
            cap: DEFAULT_CAP,
            evicted: 0,
            open: HashMap::new(),
            unlinked_open: HashSet::new(),
            lazy: HashMap::new(),
            lazy_oldest: None,
        }
    }
}

impl State {
    fn put(&mut self, ino: u32, inode: Inode) {
        if let Some(e) = self.inodes.get_mut(&ino) {
            *e = Entry { inode, used: true };
            return;
        }
        self.make_room();
        self.inodes.insert(ino, Entry { inode, used: true });
    }

    /// A cached inode (`None`: not cached) if it is live: in use, and linked
    /// or referenced (`Some(None)`: freed, or unlinked and unreferenced).
    fn touch_live(&mut self, ino: u32) -> Option<Option<&Inode>> {
        let open = self.open.get(&ino).is_some_and(|&c| c > 0);
        let i = self.touch(ino)?;
        Some((i.mode != 0 && (i.links_count > 0 || open)).then_some(i))
    }

    fn touch(&mut self, ino: u32) -> Option<&Inode> {
        let e = self.inodes.get_mut(&ino)?;
        e.used = true;
        Some(&e.inode)
    }

    /// Make room for one more inode: past the cap, drop entries not used since
    /// the last sweep (second chance, an approximation of LRU at O(1) amortised
    /// cost: a sweep frees a quarter of the cap), never a pending lazytime atime.
    fn make_room(&mut self) {
        if self.inodes.len() < self.cap {
            return;
        }
        let target = self.cap * 3 / 4;
        let State {
            inodes,
            lazy,
            evicted,
            ..
        } = self;
        for _pass in 0..2 {
            let mut excess = inodes.len().saturating_sub(target);
            inodes.retain(|ino, e| {
                if excess == 0 || lazy.contains_key(ino) {
                    return true;
                }
                if std::mem::take(&mut e.used) {
                    return true;
                }
                excess -= 1;
                *evicted += 1;
                false
            });
            if inodes.len() <= target {
                break;
            }
        }
    }
}

/// Inode-cache sizes and counters (`commitfs stats`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct InodeCacheStats {
    pub cached: usize,
    pub cap: usize,
    pub evicted: u64,
}

#[derive(Default)]
pub(crate) struct InodeTable {
    st: Mutex<State>,
}

impl InodeTable {
    // ---- cache ----------------------------------------------------------------

    /// Bound the cache to about `bytes` of memory for inodes of `inode_size`
    /// bytes on disk (the decoded struct, its variable parts and the map's
    /// share; at least 1,024 inodes).
    pub fn set_budget(&self, bytes: usize, inode_size: usize) {
        let per = std::mem::size_of::<(u32, Entry)>() + inode_size + 64;
        self.st.lock().cap = (bytes / per).max(1024);
    }

    pub fn cache_stats(&self) -> InodeCacheStats {
        let st = self.st.lock();
        InodeCacheStats {
            cached: st.inodes.len(),
            cap: st.cap,
            evicted: st.evicted,
        }
    }

    /// A copy of the cached inode.
    pub fn get(&self, ino: u32) -> Option<Inode> {
        self.st.lock().touch(ino).cloned()
    }

    /// The attributes of a cached inode that is live (links, or open), without
    /// `Inner`: `None` when it is not cached (the caller asks `Inner`),
    /// `Some(Err(NotFound))` when it is freed or unlinked and closed.
    pub fn cached_attr(&self, ino: u32, bs: usize) -> Option<crate::Result<crate::Attr>> {
        self.with_live(ino, |i| crate::ops::attr_from(ino, i, bs))
            .map(|r| r.and_then(|a| a))
    }

    /// `f` of a cached inode that is live (as [`Self::cached_attr`]), without
    /// `Inner` and without copying it: `None` when it is not cached,
    /// `Some(Err(NotFound))` when it is freed or unlinked and closed.
    pub fn with_live<R>(&self, ino: u32, f: impl FnOnce(&Inode) -> R) -> Option<crate::Result<R>> {
        let mut st = self.st.lock();
        Some(match st.touch_live(ino)? {
            Some(i) => Ok(f(i)),
            None => Err(crate::FsError::NotFound),
        })
    }

    /// `f` of the cached inode, without copying it.
    pub fn with<R>(&self, ino: u32, f: impl FnOnce(&Inode) -> R) -> Option<R> {
        self.st.lock().touch(ino).map(f)
    }

    /// Cache an inode read from its table.
    pub fn insert(&self, ino: u32, inode: Inode) {
        self.st.lock().put(ino, inode);
    }

    /// Cache an inode just written to its table buffer (which now holds
    /// whatever atime the cache had).
    pub fn store_written(&self, ino: u32, inode: Inode) {
        let mut st = self.st.lock();
        st.put(ino, inode);
        if !st.lazy.is_empty() {
            st.lazy.remove(&ino);
        }
    }

    pub fn remove(&self, ino: u32) {
        self.st.lock().inodes.remove(&ino);
    }

    /// Drop every cached inode (after a journal replay).
    pub fn clear(&self) {
        self.st.lock().inodes.clear();
    }

    // ---- open counts ------------------------------------------------------------

    /// One more open file handle of `ino`.
    pub fn open(&self, ino: u32) {
        *self.st.lock().open.entry(ino).or_insert(0) += 1;
    }

    pub fn is_open(&self, ino: u32) -> bool {
        self.st.lock().open.get(&ino).is_some_and(|&c| c > 0)
    }

    /// One handle of `ino` closed: `true` when it was the last one of an inode
    /// unlinked while open (the caller frees it).
    pub fn release(&self, ino: u32) -> bool {
        let mut st = self.st.lock();
        let left = match st.open.get_mut(&ino) {
            Some(c) => {
                *c = c.saturating_sub(1);
                *c
            }
            None => return false,
        };
        if left > 0 {
            return false;
        }
        st.open.remove(&ino);
        st.unlinked_open.remove(&ino)
    }

    /// [`Self::release`] unless this is the last handle of an inode unlinked
    /// while open (`false`: nothing done, the caller releases it under
    /// `Inner` and frees it). Decided and counted under one lock with
    /// [`Self::mark_unlinked_if_open`], so a close racing the removal of the
    /// last link either leaves it open (the removal keeps it for this close
    /// to free) or closed (the removal frees it).
    pub fn release_unless_last_unlinked(&self, ino: u32) -> bool {
        let mut st = self.st.lock();
        let last = st.open.get(&ino).is_none_or(|&c| c <= 1);
        if last && st.unlinked_open.contains(&ino) {
            return false;
        }
        match st.open.get_mut(&ino) {
            Some(c) if *c > 1 => *c -= 1,
            Some(_) => {
                st.open.remove(&ino);
            }
            None => {}
        }
        true
    }

    /// `ino` lost its last link: `true` (and marked unlinked-open, freed at
    /// its last close) when a handle has it open, `false` when it can be
    /// freed now.
    ///
    /// When it can be freed, its cached copy goes at once, in the same
    /// critical section: [`Self::open_if_live`] then sends an open racing the
    /// removal to `Inner`, which serialises it after the free.
    pub fn mark_unlinked_if_open(&self, ino: u32) -> bool {
        let mut st = self.st.lock();
        if st.open.get(&ino).is_some_and(|&c| c > 0) {
            st.unlinked_open.insert(ino);
            true
        } else {
            st.inodes.remove(&ino);
            st.lazy.remove(&ino);
            false
        }
    }

    /// One more reference to a cached live inode, without `Inner`
    /// (`Fs::open_inode`): `None` when it is not cached or not live (the
    /// caller asks `Inner`, which answers the exact error).
    pub fn open_if_live(&self, ino: u32) -> Option<()> {
        let mut st = self.st.lock();
        st.touch_live(ino)??;
        *st.open.entry(ino).or_insert(0) += 1;
        Some(())
    }

    /// Undo [`Self::mark_unlinked_if_open`] (the removal failed).
    pub fn unmark_unlinked_open(&self, ino: u32) {
        self.st.lock().unlinked_open.remove(&ino);
    }

    /// `ino` was freed: no handle counts for it any more.
    pub fn forget_open(&self, ino: u32) {
        self.st.lock().open.remove(&ino);
    }

    /// Every open-unlinked inode, forgetting their handles (unmount frees them).
    pub fn take_unlinked_open(&self) -> Vec<u32> {
        let mut st = self.st.lock();
        let v: Vec<u32> = st.unlinked_open.drain().collect();
        for ino in &v {
            st.open.remove(ino);
        }
        v
    }

    // ---- lazytime ---------------------------------------------------------------

    /// Cache `inode` with an atime the table does not have yet, since `secs`
    /// (kept if older); returns the oldest such time.
    pub fn lazy_note(&self, ino: u32, inode: Inode, secs: u64) -> u64 {
        let mut st = self.st.lock();
        st.put(ino, inode);
        st.lazy.entry(ino).or_insert(secs);
        *st.lazy_oldest.get_or_insert(secs)
    }

    /// Change the cached copy of `ino` in place with `f` (true: it set a new
    /// atime, which the inode table does not have yet, pending since `secs`);
    /// `None` when `ino` is not cached. Under the table's own lock, so no
    /// other change to the cached copy is lost.
    pub fn touch_lazy(
        &self,
        ino: u32,
        secs: u64,
        f: impl FnOnce(&mut Inode) -> bool,
    ) -> Option<bool> {
        let mut st = self.st.lock();
        let e = st.inodes.get_mut(&ino)?;
        if !f(&mut e.inode) {
            return Some(false);
        }
        e.used = true;
        st.lazy.entry(ino).or_insert(secs);
        st.lazy_oldest.get_or_insert(secs);
        Some(true)
    }

    /// The oldest pending atime's coarse seconds, if any.
    pub fn lazy_oldest(&self) -> Option<u64> {
        self.st.lock().lazy_oldest
    }

    pub fn lazy_is_empty(&self) -> bool {
        self.st.lock().lazy.is_empty()
    }

    /// Whether `ino` has a pending lazytime atime.
    pub fn has_lazy(&self, ino: u32) -> bool {
        self.st.lock().lazy.contains_key(&ino)
    }

    /// Inodes with a pending lazytime atime: `only` (if pending), or all.
    pub fn lazy_inos(&self, only: Option<u32>) -> Vec<u32> {
        let st = self.st.lock();
        match only {
            Some(ino) if st.lazy.contains_key(&ino) => vec![ino],
            Some(_) => Vec::new(),
            None => st.lazy.keys().copied().collect(),
        }
    }

    /// Inodes whose pending lazytime atime is at least `expiry` seconds old.
    pub fn lazy_expired(&self, now_secs: u64, expiry: u64) -> Vec<u32> {
        self.st
            .lock()
            .lazy
            .iter()
            .filter(|(_, &since)| now_secs.saturating_sub(since) >= expiry)
            .map(|(&ino, _)| ino)
            .collect()
    }

    /// Recompute the oldest pending lazytime atime after some were written.
    pub fn lazy_refresh_oldest(&self) {
        let mut st = self.st.lock();
        st.lazy_oldest = st.lazy.values().copied().min();
    }
}
