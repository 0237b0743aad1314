//! The consistent hash ring that shards functions over controller replicas.
//!
//! [`HashRing`] is an immutable value: a membership change builds a new ring
//! (see [`HashRing::with_member`] / [`HashRing::without_member`]) and
//! publishes it through a [`RingHandle`]. Lookups borrow from the value: they
//! never lock and never allocate.
//!
//! Algorithm (bit-exact with the Go implementation): each member IP owns
//! [`VNODES`] positions [`vnode_hash`]`(ip, idx)`; on a position collision the
//! member added first keeps it; a function's key is its [`FunctionId::fold32`];
//! its owner is the member at the first position `>= key`, wrapping to the
//! lowest position.

mod handle;
mod hash;

use std::sync::Arc;

pub use handle::{RingError, RingHandle};
pub use hash::{VNODES, fmix32, vnode_hash};

use crate::domain::FunctionId;

/// An immutable consistent hash ring.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HashRing {
    /// Sorted vnode positions.
    positions: Vec<u32>,
    /// `owners[i]` indexes `members` for `positions[i]`.
    owners: Vec<u16>,
    /// Members in the order they were added (which decides collisions).
    members: Vec<Arc<str>>,
    /// Members in lexicographic order (the published membership list).
    sorted: Vec<Arc<str>>,
}

impl HashRing {
    /// Builds a ring from members added in the given order. Duplicates are
    /// ignored (adding a present member is a no-op).
    #[must_use]
    pub fn new<I, S>(members: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut list: Vec<Arc<str>> = Vec::new();
        for m in members {
            let m = m.as_ref();
            if !list.iter().any(|x| &**x == m) {
                list.push(Arc::from(m));
            }
        }
        let mut pairs: Vec<(u32, u16)> = Vec::with_capacity(list.len() * usize::from(VNODES));
        for (i, m) in list.iter().enumerate() {
            let i = u16::try_from(i).expect("fewer than 65536 ring members");
            pairs.extend((0..VNODES).map(|v| (vnode_hash(m, v), i)));
        }
        // Sorting by (position, member index) and keeping the first of each
        // position gives a collided position to the member added first.
        pairs.sort_unstable();
        pairs.dedup_by_key(|&mut (p, _)| p);
        Self::from_parts(pairs, list)
    }

    /// A new ring with `ip` added after the current members. Positions that
    /// collide with an existing member's stay with that member.
    #[must_use]
    pub fn with_member(&self, ip: &str) -> Self {
        if self.contains(ip) {
            return self.clone();
        }
        let mut members = self.members.clone();
        members.push(Arc::from(ip));
        let new_idx = u16::try_from(members.len() - 1).expect("fewer than 65536 ring members");
        let mut pairs: Vec<(u32, u16)> = self
            .positions
            .iter()
            .copied()
            .zip(self.owners.iter().copied())
            .collect();
        pairs.reserve(usize::from(VNODES));
        let mut fresh: Vec<u32> = (0..VNODES).map(|i| vnode_hash(ip, i)).collect();
        fresh.sort_unstable();
        fresh.dedup();
        for p in fresh {
            if self.positions.binary_search(&p).is_err() {
                pairs.push((p, new_idx));
            }
        }
        pairs.sort_unstable_by_key(|&(p, _)| p);
        Self::from_parts(pairs, members)
    }

    /// A new ring without `ip`. Its positions disappear; a position it won in
    /// a collision is not handed to the member that lost it.
    #[must_use]
    pub fn without_member(&self, ip: &str) -> Self {
        let Some(gone) = self.members.iter().position(|m| &**m == ip) else {
            return self.clone();
        };
        let mut members = self.members.clone();
        members.remove(gone);
        let gone = u16::try_from(gone).expect("fewer than 65536 ring members");
        let pairs = self
            .positions
            .iter()
            .zip(&self.owners)
            .filter(|&(_, &o)| o != gone)
            .map(|(&p, &o)| (p, if o > gone { o - 1 } else { o }))
            .collect();
        Self::from_parts(pairs, members)
    }

    fn from_parts(pairs: Vec<(u32, u16)>, members: Vec<Arc<str>>) -> Self {
        let (positions, owners) = pairs.into_iter().unzip();
        let mut sorted = members.clone();
        sorted.sort();
        Self {
            positions,
            owners,
            members,
            sorted,
        }
    }

    /// Whether the ring has no members.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Whether `ip` is a member.
    #[must_use]
    pub fn contains(&self, ip: &str) -> bool {
        self.members.iter().any(|m| &**m == ip)
    }

    /// Members in lexicographic order.
    #[must_use]
    pub fn sorted_members(&self) -> &[Arc<str>] {
        &self.sorted
    }

    /// Number of vnode positions on the ring.
    #[must_use]
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// The owner of a 32-bit key, or `None` for an empty ring.
    #[must_use]
    pub fn owner_of_key(&self, key: u32) -> Option<&str> {
        self.position_of_key(key).map(|(_, owner)| owner)
    }

    /// The ring position serving `key` and its owner, or `None` for an empty ring.
    #[must_use]
    pub fn position_of_key(&self, key: u32) -> Option<(u32, &str)> {
        if self.positions.is_empty() {
            return None;
        }
        let mut i = self.positions.partition_point(|&p| p < key);
        if i == self.positions.len() {
            i = 0;
        }
        Some((self.positions[i], &self.members[usize::from(self.owners[i])]))
    }

    /// The owner of a function, or `None` for an empty ring.
    #[must_use]
    pub fn owner(&self, id: FunctionId) -> Option<&str> {
        self.owner_of_key(id.fold32())
    }

    /// Per member (lexicographic order): its number of positions and the share
    /// of the 32-bit key space it owns (a position owns the keys from just
    /// after its predecessor up to itself).
    #[must_use]
    pub fn distribution(&self) -> Vec<(Arc<str>, usize, f64)> {
        let mut count = vec![0usize; self.members.len()];
        let mut span = vec![0u64; self.members.len()];
        let n = self.positions.len();
        for i in 0..n {
            let owner = usize::from(self.owners[i]);
            count[owner] += 1;
            let prev = if i == 0 {
                self.positions[n - 1]
            } else {
                self.positions[i - 1]
            };
            let width = if n == 1 {
                1u64 << 32
            } else {
                u64::from(self.positions[i].wrapping_sub(prev))
            };
            span[owner] += width;
        }
        let mut out: Vec<_> = self
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| {
                // Precision loss is irrelevant for a share of 2^32.
                #[allow(clippy::cast_precision_loss)]
                let share = span[i] as f64 / (1u64 << 32) as f64;
                (m.clone(), count[i], share)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Share of the 32-bit key space whose owner differs between `self` and `other`.
    #[must_use]
    pub fn moved_share(&self, other: &HashRing) -> f64 {
        // Walk the union of both rings' boundaries; between consecutive
        // boundaries every key has the same owner in each ring.
        let mut bounds: Vec<u32> = self.positions.iter().chain(&other.positions).copied().collect();
        bounds.sort_unstable();
        bounds.dedup();
        if bounds.is_empty() {
            return 0.0;
        }
        let mut moved = 0u64;
        for (i, &b) in bounds.iter().enumerate() {
            let prev = if i == 0 {
                bounds[bounds.len() - 1]
            } else {
                bounds[i - 1]
            };
            let width = if bounds.len() == 1 {
                1u64 << 32
            } else {
                u64::from(b.wrapping_sub(prev))
            };
            if self.owner_of_key(b) != other.owner_of_key(b) {
                moved += width;
            }
        }
        #[allow(clippy::cast_precision_loss)]
        let share = moved as f64 / (1u64 << 32) as f64;
        share
    }
}
