//! Shards, for spreading leases over cluster members: which of `N` shards
//! a lease belongs to, which live member should lead each shard, and how a
//! batch naming leases of several shards is split into one part per shard
//! and its answers merged back ([`Split`]).
//!
//! A lease's shard is `h(name) mod N`, where `h(name)` is the first eight
//! bytes of the SHA-256 digest of the name's bytes, read as a big-endian
//! unsigned 64-bit integer: any language computes it with its standard
//! library. With `N = 1` every lease is in shard 0.
//!
//! Shards go to members by rendezvous (highest random weight) hashing,
//! capped for balance: shard `k` ranks the members by the first eight bytes
//! (big-endian) of SHA-256(`member name` + `"\n"` + `k` in decimal), and
//! shards, in order, take the highest-ranked member that leads fewer than
//! `ceil(N / M)` of them. A member that joins or leaves moves few shards,
//! and no member leads more than its share.

use sha2::{Digest, Sha256};

use crate::names::LeaseName;

/// The first eight bytes of SHA-256 of `bytes`, big-endian.
fn h64(bytes: &[u8]) -> u64 {
    let digest = Sha256::digest(bytes);
    u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"))
}

/// The shard of lease `name` among `shards` (at least 1).
pub fn shard_of(name: &str, shards: u32) -> u32 {
    (h64(name.as_bytes()) % u64::from(shards.max(1))) as u32
}

/// How much `member` wants shard `shard`.
fn weight(member: &str, shard: u32) -> u64 {
    h64(format!("{member}\n{shard}").as_bytes())
}

/// Which of `members` (by index) should lead each of `shards` shards:
/// `None` for every shard when there is no member.
pub fn assign(shards: u32, members: &[&str]) -> Vec<Option<usize>> {
    if members.is_empty() {
        return vec![None; shards as usize];
    }
    let cap = (shards as usize).div_ceil(members.len());
    let mut load = vec![0usize; members.len()];
    (0..shards)
        .map(|shard| {
            let mut ranked: Vec<usize> = (0..members.len()).collect();
            // Highest weight first; the name breaks a tie.
            ranked.sort_by(|&a, &b| {
                weight(members[b], shard)
                    .cmp(&weight(members[a], shard))
                    .then(members[a].cmp(members[b]))
            });
            let pick = ranked.into_iter().find(|&m| load[m] < cap)?;
            load[pick] += 1;
            Some(pick)
        })
        .collect()
}

/// A batch (a renewal naming several leases) split by shard: each part's
/// shard (`None`: items that name no lease, which the lease API answers
/// one by one) and the positions of its items in the batch, parts in shard
/// order, items in batch order.
#[derive(Debug, PartialEq, Eq)]
pub struct Split {
    parts: Vec<(Option<u32>, Vec<usize>)>,
    len: usize,
}

impl Split {
    /// Splits a batch whose items name `names` (`None`: an item without a
    /// name) among `shards` shards.
    pub fn new<'a>(names: impl IntoIterator<Item = Option<&'a str>>, shards: u32) -> Self {
        let mut groups: std::collections::BTreeMap<Option<u32>, Vec<usize>> = Default::default();
        let mut len = 0;
        for (i, name) in names.into_iter().enumerate() {
            let shard = name
                .and_then(|name| LeaseName::new(name).ok())
                .map(|name| shard_of(name.as_str(), shards));
            groups.entry(shard).or_default().push(i);
            len = i + 1;
        }
        Self {
            parts: groups.into_iter().collect(),
            len,
        }
    }

    /// The parts: each one's shard and its items' positions in the batch.
    pub fn parts(&self) -> &[(Option<u32>, Vec<usize>)] {
        &self.parts
    }

    /// Puts the parts' answers back in the batch's order: `answers` in the
    /// order of [`Split::parts`], each with one result per item of its part
    /// (`Ok`) or one answer for all of them (`Err`: the part was refused
    /// whole, or its answer could not be read). An `Ok` with another number
    /// of results than its part has items, or a part with no answer, counts
    /// as `missing` for each of its items.
    pub fn merge<T: Clone>(
        &self,
        answers: impl IntoIterator<Item = Result<Vec<T>, T>>,
        missing: T,
    ) -> Vec<T> {
        let mut merged = vec![missing.clone(); self.len];
        let mut answers = answers.into_iter();
        for (_, items) in &self.parts {
            match answers.next() {
                Some(Ok(results)) if results.len() == items.len() => {
                    for (&i, result) in items.iter().zip(results) {
                        merged[i] = result;
                    }
                }
                Some(Err(whole)) => {
                    for &i in items {
                        merged[i] = whole.clone();
                    }
                }
                _ => {}
            }
        }
        merged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_split_by_shard_and_merged_back_in_order() {
        let names = [
            Some("orders"),
            Some("a"),
            None,
            Some("lease-42"),
            Some("orders"),
            Some("../x"),
        ];
        let split = Split::new(names, 12);
        // orders: 4, a: 10, lease-42: 1; no name and a bad name: None.
        assert_eq!(
            split.parts(),
            [
                (None, vec![2, 5]),
                (Some(1), vec![3]),
                (Some(4), vec![0, 4]),
                (Some(10), vec![1])
            ]
        );
        let answers = vec![
            Err("bad"),
            Ok(vec!["r3"]),
            Ok(vec!["r0", "r4"]),
            Ok(vec!["r1", "extra"]),
        ];
        assert_eq!(
            split.merge(answers, "lost"),
            ["r0", "lost", "bad", "r3", "r4", "bad"]
        );
        assert_eq!(
            Split::new([Some("a"), Some("a")], 1).parts(),
            [(Some(0), vec![0, 1])]
        );
        assert_eq!(
            Split::new([], 4).merge(Vec::<Result<Vec<u8>, u8>>::new(), 0),
            Vec::<u8>::new()
        );
    }

    /// Fixed vectors, checked against Python's hashlib:
    /// `int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % n`.
    #[test]
    fn the_shard_of_a_name_is_fixed() {
        assert_eq!(h64(b"orders"), 2_023_957_755_765_852_388);
        assert_eq!(shard_of("orders", 12), 4);
        assert_eq!(shard_of("a", 12), 10);
        assert_eq!(shard_of("lease-42", 12), 1);
        assert_eq!(shard_of("orders", 1), 0);
        assert_eq!(shard_of("orders", 0), 0, "no shards counts as one");
    }

    #[test]
    fn every_member_leads_at_most_its_share() {
        let names = ["m0", "m1", "m2", "m3", "m4"];
        for m in 1..=names.len() {
            for n in 1..=24u32 {
                let a = assign(n, &names[..m]);
                let cap = (n as usize).div_ceil(m);
                assert!(a.iter().all(Option::is_some), "{n} shards, {m} members");
                for member in 0..m {
                    let led = a.iter().filter(|x| **x == Some(member)).count();
                    assert!(led <= cap, "{n} shards, {m} members: {led} > {cap}");
                }
            }
        }
        assert_eq!(assign(3, &[]), vec![None, None, None]);
    }

    #[test]
    fn a_member_that_leaves_moves_only_its_shards_and_a_few_more() {
        let before = assign(12, &["a", "b", "c"]);
        let after = assign(12, &["a", "b"]);
        let moved = (0..12)
            .filter(|&k| before[k] != Some(2) && before[k] != after[k])
            .count();
        // 12 shards over 2 members: 6 each; c's 4 move, and rebalancing
        // moves at most a few of the others.
        assert!(
            moved <= 4,
            "{moved} shards moved besides c's: {before:?} {after:?}"
        );
    }
}
