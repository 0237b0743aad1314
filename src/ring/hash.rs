//! The virtual-node hash: FNV-1a 32 over `ip ':' idx_hi idx_lo`, then the
//! murmur3 `fmix32` finalizer. Bit-exact with the Go implementation.

/// Virtual nodes per ring member.
pub const VNODES: u16 = 1024;

const FNV_OFFSET: u32 = 2_166_136_261;
const FNV_PRIME: u32 = 16_777_619;

/// Position of virtual node `idx` of member `ip` on the 32-bit ring.
#[must_use]
pub fn vnode_hash(ip: &str, idx: u16) -> u32 {
    let [hi, lo] = idx.to_be_bytes();
    let mut h = FNV_OFFSET;
    for &b in ip.as_bytes().iter().chain(&[b':', hi, lo]) {
        h ^= u32::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    fmix32(h)
}

/// murmur3's 32-bit avalanche finalizer.
#[must_use]
pub fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_vnodes_of_10_0_0_1() {
        assert_eq!(vnode_hash("10.0.0.1", 0), 0x7a8b_3eb2);
        assert_eq!(vnode_hash("10.0.0.1", 256), 0x9a01_af37);
    }

    #[test]
    fn avalanche_on_low_index_bit() {
        // Flipping the low bit of the index flips each output bit 30-70% of the time.
        let mut flips = [0u32; 32];
        let trials = 10_000u32;
        for t in 0..trials {
            let ip = format!("10.{}.{}.{}", t >> 16 & 0xff, t >> 8 & 0xff, t & 0xff);
            let d = vnode_hash(&ip, 0) ^ vnode_hash(&ip, 1);
            for (bit, count) in flips.iter_mut().enumerate() {
                *count += (d >> bit) & 1;
            }
        }
        for (bit, &count) in flips.iter().enumerate() {
            let share = f64::from(count) / f64::from(trials);
            assert!((0.3..=0.7).contains(&share), "bit {bit}: {share}");
        }
    }
}
