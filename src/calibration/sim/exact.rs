//! Exact fixed-point arithmetic for the truth: an `f64` taken apart into integers, and `n * 2^shift / d`
//! by long division, so that no absolute tick or ns value passes through an `f64`.

/// `x = mantissa * 2^exponent` exactly, for a positive finite `x`.
pub(super) fn decompose(x: f64) -> (u64, i32) {
    let bits = x.to_bits();
    let biased = ((bits >> 52) & 0x7ff) as i32;
    let fraction = bits & ((1u64 << 52) - 1);
    if biased == 0 {
        (fraction, -1074)
    } else {
        (fraction | (1u64 << 52), biased - 1075)
    }
}

/// `floor(n * 2^shift / d)` modulo 2^128, and whether the division left a remainder. `d > 0`.
pub(super) fn mul_pow2_div_floor(n: u128, shift: i32, d: u64) -> (u128, bool) {
    let d = d as u128;
    if shift <= 0 {
        let k = shift.unsigned_abs();
        let (shifted, lost) = if k >= 128 {
            (0, n != 0)
        } else {
            (n >> k, n & ((1u128 << k) - 1) != 0)
        };
        return (shifted / d, lost || shifted % d != 0);
    }
    // n * 2^s / d = (n / d) * 2^s + (n % d) * 2^s / d, the second by long division in chunks of 64 bits
    // (the remainder stays below d < 2^64, so remainder * 2^64 fits).
    let mut quotient = n / d;
    let mut remainder = n % d;
    let mut left = shift.unsigned_abs();
    while left > 0 {
        let k = left.min(64);
        let widened = remainder << k;
        quotient = shl_wrapping(quotient, k).wrapping_add(widened / d);
        remainder = widened % d;
        left -= k;
    }
    (quotient, remainder != 0)
}

/// `x * 2^k` modulo 2^128 (k ≤ 64 here, but any k works).
fn shl_wrapping(x: u128, k: u32) -> u128 {
    if k >= 128 {
        0
    } else {
        x << k
    }
}
