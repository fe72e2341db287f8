//! Data-block tracking for single-flush commits (`fc_data_csum`, docs/FORMAT.md
//! "Single-flush full commits").
//!
//! The file system reports every data block it writes ([`crate::Journal::note_data`])
//! and frees ([`crate::Journal::forget_data`]); the journal keeps, per transaction,
//! the blocks written since the last flush. A commit puts their CRC32Cs in its
//! commit block, and the blocks stay *guarded* (must not be overwritten in place by
//! another transaction) while the commit runs and, after a single-flush commit,
//! until a later commit is durable behind it ([`crate::Journal::data_conflict`],
//! [`crate::Journal::confirm_data`]).

use std::collections::BTreeMap;

/// A set of block numbers as disjoint, non-adjacent runs `start -> end`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RangeSet(BTreeMap<u64, u64>);

impl RangeSet {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Add `[s, e)`.
    pub fn insert(&mut self, s: u64, e: u64) {
        if s >= e {
            return;
        }
        let (mut s, mut e) = (s, e);
        if let Some((&ps, &pe)) = self.0.range(..=s).next_back() {
            if pe >= s {
                s = ps;
                e = e.max(pe);
                self.0.remove(&ps);
            }
        }
        while let Some((&ns, &ne)) = self.0.range(s..).next() {
            if ns > e {
                break;
            }
            e = e.max(ne);
            self.0.remove(&ns);
        }
        self.0.insert(s, e);
    }

    /// Remove `[s, e)`.
    pub fn remove(&mut self, s: u64, e: u64) {
        if s >= e {
            return;
        }
        let over: Vec<(u64, u64)> = self
            .0
            .range(..e)
            .rev()
            .take_while(|(_, &pe)| pe > s)
            .map(|(&a, &b)| (a, b))
            .collect();
        for (ps, pe) in over {
            self.0.remove(&ps);
            if ps < s {
                self.0.insert(ps, s);
            }
            if pe > e {
                self.0.insert(e, pe);
            }
        }
    }

    /// Whether any block of `[s, e)` is in the set.
    pub fn overlaps(&self, s: u64, e: u64) -> bool {
        s < e && self.0.range(..e).next_back().is_some_and(|(_, &pe)| pe > s)
    }

    pub fn union(&mut self, o: &RangeSet) {
        for (&s, &e) in &o.0 {
            self.insert(s, e);
        }
    }

    /// The runs `(start, len)`, split so each length fits a u32.
    pub fn runs(&self) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        for (&s, &e) in &self.0 {
            let mut b = s;
            while b < e {
                let n = (e - b).min(u32::MAX as u64);
                out.push((b, n as u32));
                b += n;
            }
        }
        out
    }
}

/// Per-journal data tracking state (inside the running-transaction lock, so the
/// tid switch of a commit and the guard checks see one consistent picture).
#[derive(Debug, Default)]
pub(crate) struct DataTrack {
    /// Single-flush commits are on (the file system asked and the log has
    /// CSUM_V3); nothing below is used otherwise.
    pub on: bool,
    /// Data blocks the running transaction wrote since the last flush.
    pub running: RangeSet,
    /// Blocks of `running` a flush in progress is making durable.
    pub flushing: RangeSet,
    /// The transactions in flight and their data blocks.
    pub committing: BTreeMap<u32, RangeSet>,
    /// The last commit if it was single-flush with data ranges, until a later
    /// commit (fast or full) is durable behind it: recovery verifies those ranges
    /// while it is the last transaction in the log.
    pub protected: Option<(u32, RangeSet)>,
    /// A chained fast commit (its flush left to a successor) follows
    /// `protected`: once a flush numbered after this completes, `protected` is
    /// non-final ([`Self::settle`]); until then a crash may leave it last.
    pub unprotect_after: Option<u64>,
}

impl DataTrack {
    /// Apply [`Self::unprotect_after`] once flush generation `done` (the highest
    /// completed) has passed it.
    pub fn settle(&mut self, done: u64) {
        if self.unprotect_after.is_some_and(|g| done > g) {
            self.unprotect_after = None;
            self.protected = None;
        }
    }

    /// A transaction other than `tid` (the caller's) guards a block of `[s, e)`.
    pub fn conflict(&self, s: u64, e: u64) -> Option<u32> {
        for (t, set) in self
            .committing
            .iter()
            .chain(self.protected.iter().map(|p| (&p.0, &p.1)))
        {
            if set.overlaps(s, e) {
                return Some(*t);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_set_merges_splits_and_overlaps() {
        let mut r = RangeSet::default();
        r.insert(10, 12);
        r.insert(12, 14);
        r.insert(20, 21);
        assert_eq!(r.runs(), vec![(10, 4), (20, 1)]);
        assert!(r.overlaps(13, 100));
        assert!(!r.overlaps(14, 20));
        assert!(r.overlaps(0, 11));
        r.insert(5, 25);
        assert_eq!(r.runs(), vec![(5, 20)]);
        r.remove(7, 9);
        assert_eq!(r.runs(), vec![(5, 2), (9, 16)]);
        r.remove(0, 6);
        r.remove(24, 30);
        assert_eq!(r.runs(), vec![(6, 1), (9, 15)]);
        let mut o = RangeSet::default();
        o.insert(7, 9);
        r.union(&o);
        assert_eq!(r.runs(), vec![(6, 18)]);
        r.remove(0, 100);
        assert!(r.is_empty());
    }
}
