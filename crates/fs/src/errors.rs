//! What an I/O error does to the mounted file system: ext4's `errors=`
//! (`ext4_handle_error`), see docs/ARCHITECTURE.md "Device errors".
//!
//! [`ErrorState`] is shared by [`crate::Fs`], `Inner` and the periodic committer,
//! so that any of them can report an error without the file-system lock. It keeps
//! the superblock's error record, writes it home (so e2fsck runs a full check
//! next time) and switches the mount read-only (remount-ro) or dead (panic).

use std::sync::atomic::{AtomicBool, Ordering};

use commitfs_device::{DeviceRef, IoCategory};
use commitfs_format::superblock::{self as sbf, ErrorRecord, Superblock};
use commitfs_journal::Journal;
use parking_lot::Mutex;

use crate::types::ErrorsBehavior;

pub(crate) struct ErrorState {
    dev: DeviceRef,
    mode: ErrorsBehavior,
    /// Changes are refused from now on (remount-ro after an error).
    read_only: AtomicBool,
    /// errors=panic fired: every request fails, nothing is written.
    dead: AtomicBool,
    /// The superblock's error record as it should be on disk; applied to every
    /// superblock commitfs writes from now on.
    record: Mutex<ErrorRecord>,
    /// An error was recorded that the journaled superblock does not hold yet
    /// (errors=continue: the next commit logs the superblock).
    sb_update: AtomicBool,
    /// The journal's abort has been handled.
    journal_reported: AtomicBool,
    /// The last error record could not be written home (the device refused).
    record_pending: AtomicBool,
    /// An error reported under the file-system lock: its record is written by
    /// the next request, outside the lock ([`Self::write_deferred`]).
    deferred: AtomicBool,
    /// Called once when errors=panic fires (the FUSE daemon exits there).
    on_shutdown: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl ErrorState {
    pub fn new(dev: DeviceRef, mode: ErrorsBehavior, sb: &Superblock) -> ErrorState {
        ErrorState {
            dev,
            mode,
            read_only: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            record: Mutex::new(sb.error_record()),
            sb_update: AtomicBool::new(false),
            journal_reported: AtomicBool::new(false),
            on_shutdown: Mutex::new(None),
            record_pending: AtomicBool::new(false),
            deferred: AtomicBool::new(false),
        }
    }

    /// Run `f` when errors=panic fires (at once if it already has).
    pub fn on_shutdown(&self, f: Box<dyn FnOnce() + Send>) {
        if self.is_dead() {
            f();
        } else {
            *self.on_shutdown.lock() = Some(f);
        }
    }

    pub fn mode(&self) -> ErrorsBehavior {
        self.mode
    }

    /// remount-ro (or panic) after an error.
    pub fn is_read_only(&self) -> bool {
        self.read_only.load(Ordering::Acquire)
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Copy the error record into a superblock about to be written.
    pub fn apply(&self, sb: &mut Superblock) {
        sb.set_error_record(&self.record.lock());
    }

    /// A journal operation failed with `err`: when that failure aborted the
    /// journal (the first time only), handle it per `errors=`. Refusals of an
    /// already aborted journal are not new errors.
    pub fn journal_failed(&self, journal: &Journal, func: &str, err: &dyn std::fmt::Display) {
        if journal.is_aborted() && !self.journal_reported.swap(true, Ordering::AcqRel) {
            let cause = format!("journal write failed: {err}");
            self.handle(journal, func, 0, 0, &cause, false);
        }
    }

    /// Whether the in-memory superblock must be logged for a recorded error.
    pub fn take_sb_update(&self) -> bool {
        self.sb_update.swap(false, Ordering::AcqRel)
    }

    /// Handle an I/O error per `errors=`: log it, record it in the superblock
    /// (written home at once, FUA), then continue, turn read-only (aborting the
    /// journal) or stop (aborting the journal). `func` names where it happened
    /// (it lands in `s_last_error_func`), `ino`/`block` what (0: unknown).
    ///
    /// With `under_lock` the caller holds the file-system lock: the superblock
    /// write waits for the next request ([`Self::write_deferred`]), except with
    /// errors=panic, which writes it before stopping, as ext4 does.
    pub fn handle(
        &self,
        journal: &Journal,
        func: &str,
        ino: u32,
        block: u64,
        cause: &str,
        under_lock: bool,
    ) {
        if self.is_dead() {
            return;
        }
        tracing::error!(
            "commitfs: I/O error in {func}: {cause}{}{}",
            if ino != 0 {
                format!(", inode {ino}")
            } else {
                String::new()
            },
            if block != 0 {
                format!(", block {block}")
            } else {
                String::new()
            }
        );
        // Like the kernel, remount-ro and panic abort the journal first: no
        // transaction after the error may commit.
        if self.mode != ErrorsBehavior::Continue && journal.abort() {
            tracing::error!("journal aborted (errors={})", self.mode.name());
        }
        let rec = {
            let mut r = self.record.lock();
            let mut tmp = Superblock::from_raw_unchecked(&[0u8; sbf::SUPERBLOCK_SIZE]);
            tmp.set_error_record(&r);
            let line = 0;
            tmp.note_error(
                crate::inner::coarse_secs(),
                ino,
                block,
                func,
                line,
                sbf::ERR_CODE_EIO,
            );
            *r = tmp.error_record();
            r.clone()
        };
        if under_lock && self.mode != ErrorsBehavior::Panic {
            self.deferred.store(true, Ordering::Release);
        } else {
            self.write_record(&rec);
        }
        self.sb_update.store(true, Ordering::Release);
        match self.mode {
            ErrorsBehavior::Continue if journal.is_aborted() => {
                tracing::error!(
                    "errors=continue, but the journal is aborted: changes are refused \
                     (EROFS) from now on"
                );
            }
            ErrorsBehavior::Continue => {
                tracing::error!("errors=continue: the file system stays in use");
            }
            ErrorsBehavior::RemountRo => {
                if !self.read_only.swap(true, Ordering::AcqRel) {
                    tracing::error!("Remounting filesystem read-only (errors=remount-ro)");
                }
            }
            ErrorsBehavior::Panic => {
                self.read_only.store(true, Ordering::Release);
                self.dead.store(true, Ordering::Release);
                tracing::error!(
                    "errors=panic: stopping the file system now; nothing more is written, \
                     the journal is recovered at the next mount"
                );
                if let Some(f) = self.on_shutdown.lock().take() {
                    f();
                }
            }
        }
    }

    /// Put the error record into the home superblock (read back from the device,
    /// so that no uncommitted state goes with it), with FUA. A device that cannot
    /// take it any more is only logged.
    fn write_record(&self, rec: &ErrorRecord) {
        let mut raw = [0u8; sbf::SUPERBLOCK_SIZE];
        let r = self
            .dev
            .read_at(sbf::SUPERBLOCK_OFFSET, &mut raw, IoCategory::Metadata)
            .map_err(|e| e.to_string())
            .and_then(|()| Superblock::parse(&raw).map_err(|e| e.to_string()))
            .and_then(|mut sb| {
                sb.set_error_record(rec);
                self.dev
                    .write_at(
                        sbf::SUPERBLOCK_OFFSET,
                        &sb.to_bytes(),
                        IoCategory::Metadata,
                        true,
                    )
                    .map_err(|e| e.to_string())
            });
        self.record_pending.store(r.is_err(), Ordering::Release);
        if let Err(e) = r {
            tracing::error!("could not record the error in the superblock: {e}");
        }
    }

    /// Write the error record of an error reported under the lock (called
    /// without it, at the start of the next request; one atomic load otherwise).
    pub fn write_deferred(&self) {
        if self.deferred.load(Ordering::Acquire) && self.deferred.swap(false, Ordering::AcqRel) {
            let rec = self.record.lock().clone();
            self.write_record(&rec);
        }
    }

    /// At unmount after an error (not errors=panic): write the error record
    /// home if the device refused it when the error happened, so e2fsck still
    /// learns of it (the superblock only; no other state goes with it).
    pub fn retry_record(&self) {
        self.write_deferred();
        if self.is_dead() || !self.record_pending.load(Ordering::Acquire) {
            return;
        }
        let rec = self.record.lock().clone();
        self.write_record(&rec);
        if !self.record_pending.load(Ordering::Acquire) {
            tracing::info!("error recorded in the superblock at unmount");
        }
    }
}
