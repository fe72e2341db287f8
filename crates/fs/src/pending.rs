//! Blocks and inode numbers freed by transactions that are not durable yet.
//!
//! A block freed by transaction T may not be reused before T is committed:
//! a crash before that would replay the old owner's metadata over the new
//! owner's data (jbd2's rule; ext4 keeps such blocks out of the buddy cache
//! until the commit callback, `ext4_process_freed_data`). In fast-commit mode
//! full commits are seconds apart, so thousands of freed ranges build up
//! (varmail deletes a file per loop).
//!
//! The ranges are kept three ways, one per question asked of them:
//! - by start (`ranges`): which range covers a block, for checks and sums;
//! - by freeing tid (`order`): pruning pops the durable front instead of
//!   scanning the map at every allocation;
//! - per block group, as a bitmap of pending bits (`overlay`), which the
//!   allocator ORs with the group's block bitmap word by word. Before it, an
//!   allocation near the group's start stepped over the pending ranges one
//!   at a time (a bitmap scan and two map lookups each): 4% of all CPU
//!   samples under varmail with 16 threads, all under the file-system lock.
//!
//! An overlay exists only for a group with pending blocks, and is dropped
//! when its last one is pruned.

use std::collections::{BTreeMap, HashMap, VecDeque};

/// Pending bits of one block group, bit `i` of word `w` = block `64 w + i`
/// of the group (the layout of `u64::from_le_bytes` over an ext4 bitmap).
#[derive(Debug, Clone, Default)]
struct Overlay {
    words: Vec<u64>,
    set: u64,
}

/// Blocks freed by transactions not yet committed (see the module doc).
#[derive(Debug, Clone)]
pub struct PendingBlocks {
    /// start -> (end, freeing tid).
    ranges: BTreeMap<u64, (u64, u32)>,
    /// `(tid, start)` of every insertion, in order (tids never decrease).
    order: VecDeque<(u32, u64)>,
    overlay: HashMap<u32, Overlay>,
    /// Blocks in `ranges` (exactly: a range inserted twice counts once).
    blocks: u64,
    /// Some ranges overlap (a block freed twice: a corrupt image). Pruning a
    /// range then looks at every other range before clearing its bits.
    overlapping: bool,
    first_data_block: u64,
    blocks_per_group: u64,
}

impl PendingBlocks {
    pub fn new(first_data_block: u64, blocks_per_group: u32) -> Self {
        PendingBlocks {
            ranges: BTreeMap::new(),
            order: VecDeque::new(),
            overlay: HashMap::new(),
            blocks: 0,
            overlapping: false,
            first_data_block,
            blocks_per_group: blocks_per_group.max(1) as u64,
        }
    }

    /// An empty set over the same geometry.
    pub fn empty_like(&self) -> Self {
        Self::new(self.first_data_block, self.blocks_per_group as u32)
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// How many blocks are pending.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Record blocks `start..end` freed by transaction `tid`.
    pub fn insert(&mut self, start: u64, mut end: u64, tid: u32) {
        if end <= start {
            return;
        }
        if let Some(&(e0, _)) = self.ranges.get(&start) {
            // The same start freed again (a corrupt image): one range covering
            // both, pending until the later free commits (tids never decrease).
            end = end.max(e0);
            self.overlapping = true;
        }
        self.ranges.insert(start, (end, tid));
        self.order.push_back((tid, start));
        if self.set_bits(start, end, true) < end - start {
            self.overlapping = true;
        }
    }

    /// Forget the ranges whose freeing transactions are durable.
    pub fn prune(&mut self, durable: impl Fn(u32) -> bool) {
        let mut gone = Vec::new();
        prune_durable(
            &mut self.order,
            &mut self.ranges,
            |v| v.1,
            durable,
            |start, (end, _)| gone.push((start, end)),
        );
        for (start, end) in gone {
            self.set_bits(start, end, false);
            if self.overlapping {
                // Whatever other range still covers these blocks keeps its
                // bits. Every range is looked at: overlapping ranges need not
                // be ordered by their ends.
                let still: Vec<(u64, u64)> = self
                    .ranges
                    .range(..end)
                    .filter(|(_, &(e, _))| e > start)
                    .map(|(&s, &(e, _))| (s.max(start), e.min(end)))
                    .collect();
                for (s, e) in still {
                    self.set_bits(s, e, true);
                }
            }
        }
        if self.ranges.is_empty() {
            self.overlapping = false;
        }
    }

    /// How many blocks of group `g` are pending (free in its bitmap, not
    /// usable yet).
    pub fn group_pending(&self, g: u32) -> u64 {
        self.overlay.get(&g).map_or(0, |o| o.set)
    }

    /// The pending bits of group `g`, if it has any.
    pub fn group_overlay(&self, g: u32) -> Option<&[u64]> {
        self.overlay.get(&g).map(|o| o.words.as_slice())
    }

    /// Whether block `b` is pending, as the allocator sees it (its overlay
    /// bit).
    #[cfg(test)]
    pub fn contains(&self, b: u64) -> bool {
        let Some(rel) = b.checked_sub(self.first_data_block) else {
            return false;
        };
        let (g, i) = (
            (rel / self.blocks_per_group) as u32,
            rel % self.blocks_per_group,
        );
        self.group_overlay(g)
            .is_some_and(|w| w[(i / 64) as usize] & (1 << (i % 64)) != 0)
    }

    /// Set or clear the overlay bits of `start..end`; returns how many
    /// changed.
    fn set_bits(&mut self, start: u64, end: u64, on: bool) -> u64 {
        let mut changed = 0;
        let mut b = start.max(self.first_data_block);
        while b < end {
            let rel = b - self.first_data_block;
            let g = (rel / self.blocks_per_group) as u32;
            let gfirst = self.first_data_block + g as u64 * self.blocks_per_group;
            let gend = (gfirst + self.blocks_per_group).min(end);
            let words = self.blocks_per_group.div_ceil(64) as usize;
            let o = self.overlay.entry(g).or_insert_with(|| Overlay {
                words: vec![0; words],
                set: 0,
            });
            for i in (b - gfirst)..(gend - gfirst) {
                let (w, m) = ((i / 64) as usize, 1u64 << (i % 64));
                let was = o.words[w] & m != 0;
                if on && !was {
                    o.words[w] |= m;
                    o.set += 1;
                    self.blocks += 1;
                    changed += 1;
                } else if !on && was {
                    o.words[w] &= !m;
                    o.set -= 1;
                    self.blocks -= 1;
                    changed += 1;
                }
            }
            if o.set == 0 {
                self.overlay.remove(&g);
            }
            b = gend;
        }
        changed
    }
}

/// Inode numbers freed by transactions not yet committed: not reused until
/// then (like the kernel's `recently_deleted`): a fast commit's INODE record
/// of a reused number would overwrite, at replay, the committed record whose
/// `i_dtime` may still link the on-disk orphan list.
#[derive(Debug, Clone, Default)]
pub struct PendingInodes {
    /// ino -> freeing tid.
    by_ino: BTreeMap<u32, u32>,
    /// `(tid, ino)` of every insertion, in order: pruning pops the durable
    /// front (as [`PendingBlocks`]), and only then may the group's inode
    /// hint go back to the freed number. Without it, postmark-like work
    /// (creates and unlinks, no commit for seconds) rescanned every pending
    /// number at each create: 28% of the library's CPU.
    order: VecDeque<(u32, u32)>,
    /// Per group, how many of its free inodes are pending: a group whose
    /// free inodes are all pending is skipped without a scan.
    in_group: Vec<u32>,
    inodes_per_group: u32,
}

impl PendingInodes {
    pub fn new(groups: u32, inodes_per_group: u32) -> Self {
        PendingInodes {
            in_group: vec![0; groups as usize],
            inodes_per_group,
            ..Default::default()
        }
    }

    /// An empty set for the same geometry.
    pub fn empty_like(&self) -> Self {
        Self::new(self.in_group.len() as u32, self.inodes_per_group)
    }

    pub fn is_empty(&self) -> bool {
        self.by_ino.is_empty()
    }

    pub fn contains(&self, ino: u32) -> bool {
        self.by_ino.contains_key(&ino)
    }

    /// How many of group `g`'s free inodes are pending.
    pub fn in_group(&self, g: u32) -> u32 {
        self.in_group.get(g as usize).copied().unwrap_or(0)
    }

    fn group_of(&self, ino: u32) -> usize {
        (ino.saturating_sub(1) / self.inodes_per_group.max(1)) as usize
    }

    /// `ino` was freed by transaction `tid`.
    pub fn insert(&mut self, ino: u32, tid: u32) {
        if self.by_ino.insert(ino, tid).is_none() {
            let g = self.group_of(ino);
            if let Some(n) = self.in_group.get_mut(g) {
                *n += 1;
            }
        }
        self.order.push_back((tid, ino));
    }

    /// Numbers whose freeing transaction is `durable` become reusable;
    /// `freed` sees each.
    pub fn prune(&mut self, durable: impl Fn(u32) -> bool, mut freed: impl FnMut(u32)) {
        let mut out = Vec::new();
        prune_durable(
            &mut self.order,
            &mut self.by_ino,
            |&tid| tid,
            durable,
            |ino, _| out.push(ino),
        );
        for ino in out {
            let g = self.group_of(ino);
            if let Some(n) = self.in_group.get_mut(g) {
                *n = n.saturating_sub(1);
            }
            freed(ino);
        }
    }
}

/// Pending frees (blocks or inode numbers) whose freeing transaction is
/// durable leave `map`: pop them from the front of `order` (`(tid, key)` in
/// insertion order, tids never decreasing) instead of scanning the map. An
/// entry a later free of the same key replaced (another tid) stays.
/// `removed` sees each entry that left.
pub(crate) fn prune_durable<K: Ord + Copy, V>(
    order: &mut VecDeque<(u32, K)>,
    map: &mut BTreeMap<K, V>,
    tid_of: impl Fn(&V) -> u32,
    durable: impl Fn(u32) -> bool,
    mut removed: impl FnMut(K, V),
) {
    while let Some(&(tid, key)) = order.front() {
        if !durable(tid) {
            break;
        }
        order.pop_front();
        if map.get(&key).is_some_and(|v| tid_of(v) == tid) {
            if let Some(v) = map.remove(&key) {
                removed(key, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_inodes_count_per_group_and_leave_when_durable() {
        // Two groups of 8 inodes: 1-8 and 9-16.
        let mut p = PendingInodes::new(2, 8);
        p.insert(3, 5);
        p.insert(9, 5);
        p.insert(10, 6);
        p.insert(10, 7); // freed again by a later transaction: counted once
        assert_eq!((p.in_group(0), p.in_group(1), p.in_group(7)), (1, 2, 0));
        assert!(p.contains(3) && p.contains(10) && !p.contains(4));
        let mut freed = Vec::new();
        p.prune(|t| t <= 6, |i| freed.push(i));
        // 10's entry is tid 7's now: it stays.
        assert_eq!(freed, vec![3, 9]);
        assert_eq!((p.in_group(0), p.in_group(1)), (0, 1));
        p.prune(|t| t <= 7, |i| freed.push(i));
        assert_eq!(freed, vec![3, 9, 10]);
        assert!(p.is_empty() && p.in_group(1) == 0);
        assert!(p.empty_like().is_empty());
    }

    #[test]
    fn overlay_follows_the_ranges() {
        let mut p = PendingBlocks::new(1, 8192);
        p.insert(10, 20, 5);
        p.insert(8190, 8196, 6); // crosses into group 1
        assert_eq!(p.blocks(), 16);
        let o0 = p.group_overlay(0).unwrap();
        // Block 10 is bit 9 of group 0 (first data block 1).
        assert_eq!(o0[0], 0x3ff << 9);
        assert!(p.group_overlay(1).is_some());
        assert!(p.contains(19) && !p.contains(20) && p.contains(8195));
        p.prune(|t| t <= 5);
        assert_eq!(p.blocks(), 6);
        assert_eq!(p.group_overlay(0).unwrap()[0], 0);
        p.prune(|t| t <= 6);
        assert!(p.is_empty() && p.group_overlay(0).is_none() && p.group_overlay(1).is_none());
        assert_eq!(p.blocks(), 0);
    }

    /// A range that covers a pruned one keeps its bits even when a range
    /// between them in start order ends earlier (review of the first cut,
    /// which stopped its look-back at that range).
    #[test]
    fn a_covering_range_behind_a_shorter_one_keeps_its_bits() {
        let mut p = PendingBlocks::new(0, 32768);
        p.insert(100, 110, 1);
        p.insert(50, 200, 2);
        p.insert(60, 70, 2);
        p.prune(|t| t <= 1);
        assert!((100..110).all(|b| p.contains(b)));
        assert_eq!(p.group_overlay(0).unwrap()[1] >> (100 - 64) & 0x3ff, 0x3ff);
        assert_eq!(p.blocks(), 150);
        p.prune(|t| t <= 2);
        assert!(p.is_empty() && p.group_overlay(0).is_none());
        assert_eq!(p.blocks(), 0);
    }

    /// The same start freed again with a shorter length keeps the longer
    /// range pending until the later free commits, and then forgets all of
    /// it (the first cut left the tail's bits set for good).
    #[test]
    fn the_same_start_freed_twice_is_one_range() {
        let mut p = PendingBlocks::new(0, 32768);
        p.insert(100, 120, 1);
        p.insert(100, 105, 2);
        p.prune(|t| t <= 1);
        assert!(p.contains(100) && p.contains(119));
        assert_eq!(p.blocks(), 20);
        p.prune(|t| t <= 2);
        assert!(p.is_empty() && p.group_overlay(0).is_none());
        assert_eq!(p.blocks(), 0);
    }

    #[test]
    fn a_double_free_keeps_the_other_ranges_bits() {
        let mut p = PendingBlocks::new(0, 32768);
        p.insert(100, 110, 1);
        p.insert(105, 120, 2);
        p.prune(|t| t <= 1);
        assert!(!p.contains(104) && p.contains(105) && p.contains(119));
        assert_eq!(p.group_overlay(0).unwrap()[1], 0x7fff << (105 - 64));
        assert_eq!(p.blocks(), 15);
    }
}
