//! Access times, by ext4's rules (the kernel's `atime_needs_update`,
//! `relatime_need_update` and lazytime writeback).
//!
//! Reads and readdirs served by the library update atime under the mount's policy.
//! An update is ordinary inode dirtiness in the running transaction: it forces no
//! commit (the periodic commit or the next sync writes it). With `lazytime` the new
//! atime stays in the inode cache only; it reaches the inode table with the next
//! other change of the inode, an fsync of it, a sync, unmount, or after
//! [`LAZYTIME_EXPIRY`].

use commitfs_format::inode::{Inode, Timestamp, FL_NOATIME};

use crate::error::Result;
use crate::inner::{coarse_secs, now, Inner};
use crate::types::{AtimeMode, MountOptions};

/// relatime: an atime older than this is refreshed even if newer than m/ctime.
const RELATIME_WINDOW_SECS: i64 = 24 * 60 * 60;

/// lazytime: an in-memory atime is written at the latest after this long (the
/// kernel's `dirtytime_expire_interval`, 12 h).
pub(crate) const LAZYTIME_EXPIRY: u64 = 12 * 60 * 60;

/// Does an access to `i` at time `t` update its atime? (`atime_needs_update`).
fn atime_due(opts: &MountOptions, i: &Inode, t: Timestamp) -> bool {
    if i.flags & FL_NOATIME != 0 || (opts.nodiratime && i.is_dir()) {
        return false;
    }
    match opts.atime {
        AtimeMode::Never => return false,
        AtimeMode::Strict => {}
        AtimeMode::Relative => {
            let stale = i.mtime >= i.atime
                || i.ctime >= i.atime
                || t.sec.saturating_sub(i.atime.sec) >= RELATIME_WINDOW_SECS;
            if !stale {
                return false;
            }
        }
    }
    i.atime != t
}

/// Whether an access to `ino` now may update its atime, decided on the inode
/// cache alone (no `Inner`): false only when the cached inode says no update
/// is due; a miss or a due update goes to [`Inner::touch_atime`].
pub(crate) fn atime_maybe_due(
    opts: &MountOptions,
    itable: &crate::itable::InodeTable,
    ino: u32,
) -> bool {
    if opts.read_only || opts.atime == AtimeMode::Never {
        return false;
    }
    let t = now();
    itable.with(ino, |i| atime_due(opts, i, t)).unwrap_or(true)
}

/// A read's atime update without `Inner`: the new atime goes into the cached
/// inode (`InodeTable::touch_lazy`). Under `relatime` / `strictatime` the next
/// periodic commit, fsync of the file, sync or unmount writes it to the inode
/// table, whichever comes first (the kernel logs it in the running
/// transaction, which its next commit writes); under `lazytime` the rules of
/// [`LAZYTIME_EXPIRY`] apply as before. `None`: the inode is not cached, the
/// caller takes [`Inner::touch_atime`]; `Some(true)`: a `lazytime` atime
/// pending for longer than the expiry is due, the caller writes those
/// ([`Inner::flush_lazy_expired_now`]).
pub(crate) fn touch_atime_deferred(
    opts: &MountOptions,
    itable: &crate::itable::InodeTable,
    ino: u32,
) -> Option<bool> {
    if opts.read_only || opts.atime == AtimeMode::Never {
        return Some(false);
    }
    let t = now();
    let secs = coarse_secs();
    let changed = itable.touch_lazy(ino, secs, |i| {
        if !atime_due(opts, i, t) {
            return false;
        }
        i.atime = t;
        true
    })?;
    Some(
        opts.lazytime
            && changed
            && itable
                .lazy_oldest()
                .is_some_and(|o| secs.saturating_sub(o) >= LAZYTIME_EXPIRY),
    )
}

impl Inner {
    /// Note an access (read, readdir) of `ino`; true if the running transaction
    /// got an inode update (the caller may then commit early when it has grown
    /// large). Never fails the access: an atime that cannot be written is only
    /// logged, as in the kernel.
    pub fn touch_atime(&mut self, ino: u32) -> bool {
        if self.read_only || self.opts.atime == AtimeMode::Never {
            return false;
        }
        match self.try_touch_atime(ino) {
            Ok(journalled) => journalled,
            Err(e) => {
                tracing::warn!("atime update of inode {ino}: {e}");
                false
            }
        }
    }

    fn try_touch_atime(&mut self, ino: u32) -> Result<bool> {
        let t = now();
        // Decide on the cached copy without cloning it (the common case: no update).
        let opts = &self.opts;
        let due = match self.itable.with(ino, |i| atime_due(opts, i, t)) {
            Some(due) => due,
            None => {
                let i = self.read_inode(ino)?;
                atime_due(&self.opts, &i, t)
            }
        };
        if !due {
            return Ok(false);
        }
        let mut i = self.read_inode(ino)?;
        i.atime = t;
        if self.opts.lazytime {
            let secs = coarse_secs();
            let oldest = self.itable.lazy_note(ino, i, secs);
            if secs.saturating_sub(oldest) >= LAZYTIME_EXPIRY {
                self.flush_lazy_expired(secs)?;
                return Ok(true);
            }
            return Ok(false);
        }
        let h = self.start(1)?;
        // Directories are never tracked by fast commits (as in the kernel); a lost
        // atime of one after a crash is harmless.
        if i.is_reg() {
            self.fc_track_inode(ino, h.tid(), None);
        }
        // Access times are not fdatasync's business (C.5).
        let r = self.write_inode_times(&h, ino, &i);
        self.stop(h)?;
        r.map(|()| true)
    }

    /// Write the pending atimes of `inos` (those still pending) to the inode
    /// table, in the running transaction.
    pub fn flush_atimes_of(&mut self, inos: &[u32]) -> Result<()> {
        let inos: Vec<u32> = inos
            .iter()
            .copied()
            .filter(|&i| self.itable.has_lazy(i))
            .collect();
        self.write_lazy(&inos)
    }

    /// Write lazytime atimes to the inode table: of `only`, or of every inode.
    pub fn flush_lazy_atimes(&mut self, only: Option<u32>) -> Result<()> {
        if self.itable.lazy_is_empty() {
            return Ok(());
        }
        let inos = self.itable.lazy_inos(only);
        if inos.is_empty() {
            return Ok(());
        }
        self.write_lazy(&inos)
    }

    /// Write the lazytime atimes older than [`LAZYTIME_EXPIRY`] now (after
    /// [`touch_atime_deferred`] found one); true if any was written.
    pub(crate) fn flush_lazy_expired_now(&mut self) -> bool {
        match self.flush_lazy_expired(coarse_secs()) {
            Ok(wrote) => wrote,
            Err(e) => {
                tracing::warn!("lazytime atime update: {e}");
                false
            }
        }
    }

    /// Write the lazytime atimes older than [`LAZYTIME_EXPIRY`]; true if
    /// there were any.
    fn flush_lazy_expired(&mut self, now_secs: u64) -> Result<bool> {
        let inos = self.itable.lazy_expired(now_secs, LAZYTIME_EXPIRY);
        self.write_lazy(&inos)?;
        Ok(!inos.is_empty())
    }

    fn write_lazy(&mut self, inos: &[u32]) -> Result<()> {
        if !inos.is_empty() {
            let h = self.start(inos.len().min(64) as u32)?;
            let r: Result<()> = inos.iter().try_for_each(|&ino| {
                let i = self.read_inode(ino)?;
                if i.is_reg() {
                    self.fc_track_inode(ino, h.tid(), None);
                }
                self.write_inode_times(&h, ino, &i)
            });
            self.stop(h)?;
            r?;
        }
        self.itable.lazy_refresh_oldest();
        Ok(())
    }
}
