//! Weighted rendezvous (highest random weight) hashing: which live peer owns a cluster. Every
//! replica computes the same answer from the same peer list, and a peer joining or leaving
//! moves only the clusters it gains or held.

/// A peer as the assignment sees it: its identity and its weight (its share of the fleet is
/// its weight over the total).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Peer {
    pub(crate) id: String,
    pub(crate) weight: f64,
}

/// 64-bit FNV-1a of `parts` (with a separator no text holds), then splitmix64's finaliser.
/// Fixed by this crate, not by the Rust version or the process, so that replicas of different
/// builds (a rolling update) agree.
fn hash(parts: &[&str]) -> u64 {
    mix(fnv1a(parts))
}

/// 64-bit FNV-1a of `parts`, each after the first preceded by the byte 0xff.
fn fnv1a(parts: &[&str]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = OFFSET;
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            h ^= 0xff;
            h = h.wrapping_mul(PRIME);
        }
        for byte in part.bytes() {
            h ^= u64::from(byte);
            h = h.wrapping_mul(PRIME);
        }
    }
    h
}

/// splitmix64's finaliser: FNV's high bits, which the score reads, mix poorly.
fn mix(mut h: u64) -> u64 {
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The crate's fixed 64-bit hash of `parts`, for names that must agree across replicas.
pub(crate) fn digest(parts: &[&str]) -> u64 {
    hash(parts)
}

/// The score of `peer` for `cluster`: `-weight / ln(u)` with `u` uniform in (0, 1) from the
/// hash, whose maximum over the peers falls on each peer with probability weight / total.
fn score(peer: &Peer, cluster: &str) -> f64 {
    let h = hash(&[&peer.id, cluster]);
    // 53 bits into (0, 1): never 0 (ln 0) nor 1 (ln 1 = 0).
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -peer.weight / u.ln()
}

/// The peer that owns `cluster` among `peers` (ties, which need equal scores, go to the
/// smaller id); `None` without a peer of positive weight.
pub(crate) fn owner<'p>(peers: &'p [Peer], cluster: &str) -> Option<&'p Peer> {
    peers
        .iter()
        .filter(|p| p.weight > 0.0 && p.weight.is_finite())
        .map(|p| (score(p, cluster), p))
        .max_by(|(a, pa), (b, pb)| a.total_cmp(b).then_with(|| pb.id.cmp(&pa.id)))
        .map(|(_, p)| p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn peers(ids: &[&str]) -> Vec<Peer> {
        ids.iter()
            .map(|id| Peer {
                id: id.to_string(),
                weight: 1.0,
            })
            .collect()
    }

    fn clusters(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("cluster-{i:03}")).collect()
    }

    fn shares(peers: &[Peer], clusters: &[String]) -> HashMap<String, usize> {
        let mut shares = HashMap::new();
        for c in clusters {
            *shares
                .entry(owner(peers, c).unwrap().id.clone())
                .or_default() += 1;
        }
        shares
    }

    #[test]
    fn the_hash_is_fixed_by_the_crate() {
        // Pinned values: a change would move clusters between replicas of different builds.
        assert_eq!(hash(&["a", "b"]), hash(&["a", "b"]));
        assert_ne!(hash(&["ab", ""]), hash(&["a", "b"]), "parts are separated");
        assert_eq!(
            hash(&["replica-0", "cluster-000"]),
            4_965_974_370_323_378_353
        );
        // FNV-1a's published test vectors.
        assert_eq!(fnv1a(&["a"]), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(&["foobar"]), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn three_peers_share_300_clusters_evenly() {
        let peers = peers(&["replica-a", "replica-b", "replica-c"]);
        let shares = shares(&peers, &clusters(300));
        assert_eq!(shares.values().sum::<usize>(), 300);
        for (peer, n) in &shares {
            assert!((80..=120).contains(n), "{peer}: {n} of 300 ({shares:?})");
        }
    }

    #[test]
    fn a_peer_joining_takes_only_its_share_and_leaving_moves_only_its_own() {
        let three = peers(&["replica-a", "replica-b", "replica-c"]);
        let four = peers(&["replica-a", "replica-b", "replica-c", "replica-d"]);
        let all = clusters(1000);
        let mut moved = 0;
        for c in &all {
            let before = owner(&three, c).unwrap();
            let after = owner(&four, c).unwrap();
            if before != after {
                moved += 1;
                assert_eq!(after.id, "replica-d", "{c} moved between old peers");
            }
        }
        assert!(
            (200..=300).contains(&moved),
            "{moved} of 1000 moved to the new peer"
        );
        // replica-b leaves: only its clusters move.
        let two = peers(&["replica-a", "replica-c"]);
        for c in &all {
            let before = owner(&three, c).unwrap();
            if before.id != "replica-b" {
                assert_eq!(
                    owner(&two, c).unwrap(),
                    before,
                    "{c} moved though its owner stayed"
                );
            }
        }
    }

    #[test]
    fn weights_set_the_shares_and_no_weight_owns_nothing() {
        let mut weighted = peers(&["light", "heavy", "idle"]);
        weighted[1].weight = 3.0;
        weighted[2].weight = 0.0;
        let shares = shares(&weighted, &clusters(2000));
        assert_eq!(shares.get("idle"), None);
        let heavy = shares["heavy"] as f64 / 2000.0;
        assert!(
            (0.70..=0.80).contains(&heavy),
            "heavy owns {heavy} (expected 0.75)"
        );
        assert!(owner(&[], "c").is_none());
    }
}
