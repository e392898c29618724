//! [`FastConverter`]: ticks → ns with u64 multiplies, shifts and adds only (no division, no `u128`), for
//! converting many raw ticks against one calibration segment.
//!
//! The scheme is wtmlib's mult/shift/modulus one, adapted to an anchored segment. A tick's distance `d`
//! from a base point is split into `p = d >> b` whole periods of `2^b` ticks and a remainder
//! `r = d & (2^b - 1)`, and
//!
//! ```text
//! ns = base_ns + (p * ns_per_period + ((r * mult) >> (s - f)) + offset) >> f
//! ```
//!
//! where `ns_per_period` is the ns in one period and `mult` the ns in one tick, as fixed-point numbers with
//! `f` and `s` fraction bits: `s` as large as lets `r * mult` fit 64 bits, `f` as large as lets the sum fit.
//! Unlike wtmlib's integer `ns_per_modulus`, the period's ns keep `f` fraction bits, so their rounding error
//! accumulates to a bounded fraction of a ns. That two-multiply **near path** serves a window of ticks
//! around the anchor: its base lies an eighth of the window before the anchor (so ticks just before the
//! anchor need no sign handling; `offset` carries the base's fractional ns and the rounding half), and the
//! window is as long as keeps its error below [`NEAR_ERROR_NS`] (or the general path's bound, if larger):
//! for TSC rates, from about 5 minutes before the anchor to at least 35 minutes after it.
//!
//! Every other tick (further before the anchor, beyond the window, or where the result saturates) takes the
//! **general path**: the magnitude `m = |delta|` (wrap-aware, as [`ClockCalibration::ticks_from_anchor`]) is
//! split the same way, but the period's ns are held as an integer plus a fraction with as many bits as
//! `p * fraction` fits in 64 bits (three multiplies), which keeps the error below a ns out to 2^63 ticks;
//! distances whose exact product reaches 2^64 ns saturate exactly as [`ClockCalibration::to_reference_ns`]
//! does.
//!
//! All constants, and exact bounds on their rounding errors, are computed in [`FastConverter::new`] (with
//! `u128`), which picks `b` (and the near window) to minimise the bound.

use crate::calibration::ClockCalibration;

/// The near path's error target before rounding, in ns: its window is (nearly) the longest whose bound
/// stays below this, or below the general path's bound if that is larger.
const NEAR_ERROR_NS: f64 = 1.0 / 256.0;

/// The most fraction bits the general path sums its sub-nanosecond parts with.
const MAX_SUM_FRAC_BITS: u32 = 62;

/// Relative slack added to the f64 evaluation of the (exactly known) error terms before rounding it up, so
/// the f64 rounding of that evaluation can never make the stated bound too small.
const BOUND_SLACK: f64 = 1e-9;

/// Converts raw ticks to reference ns like [`ClockCalibration::to_reference_ns`], with two (near the
/// anchor) or three u64 multiplies and no division or `u128` arithmetic: the converter to rebuild (with
/// [`new`](Self::new)) whenever the calibration changes, and to use for bulk conversion.
///
/// Ticks in the [`near_window`](Self::near_window) around the anchor (for TSC rates, from about 5 minutes
/// before it to at least 35 minutes after it) take a two-multiply path; all others a three-multiply one
/// (the module source describes the scheme).
///
/// # Error
///
/// `to_ns(t)` is within [`max_error_ns`](Self::max_error_ns)`(d)` ns of the exact `cal.to_reference_ns(t)`
/// for every tick `t` at most `d` ticks (wrap-aware) from the anchor, and within
/// [`worst_case_error_ns`](Self::worst_case_error_ns) anywhere in the u64 tick range: either side of the
/// anchor, across the counter's wrap, and where the result saturates at `0` or `u64::MAX` as the exact path
/// does. The stated bound:
///
/// * **At most 1 ns, over the whole u64 tick range, for every `ClockCalibration`** (checked for rates from
///   2^-30 to 2^30 ns per tick); **0 ns** (exact everywhere) when the rate is a power of two, such as a
///   nanosecond clock's 1.0.
/// * That 1 ns is only the final rounding. Before rounding, the fast value is within
///   [`approx_error_ns`](Self::approx_error_ns) of the exact real-valued `anchor_ns ± |delta| * rate`; for
///   a calibration's rates (made from an f64, so with at most 53 significant bits) that stays at or below
///   1/256 ns at any distance. So the fast and exact results differ, by 1, only when the exact value lies
///   that close to a half nanosecond: well under 1 conversion in 100, and far fewer close to the anchor.
/// * For an arbitrary 128-bit Q64.64 rate (which the public constructors cannot make) the error before
///   rounding can approach 1 ns (0.97 ns at worst over 300,000 random rates, near 2 ns per tick), so
///   `worst_case_error_ns()` is at most 2 there. The bound is always computed from the converter's actual
///   constants, never assumed.
///
/// ```
/// use tickline::{calibration::{ClockCalibration, ClockDomain}, clock::FastConverter};
/// // A 3 GHz TSC anchored at tick 1e12 = 5 s of CLOCK_MONOTONIC.
/// let domain = ClockDomain::new(64, 1.0 / 3.0).unwrap();
/// let cal = ClockCalibration::from_anchor(domain, 1_000_000_000_000, 5_000_000_000, 1.0 / 3.0).unwrap();
/// let fast = FastConverter::new(&cal);
/// assert_eq!(fast.worst_case_error_ns(), 1);
/// for ticks in [0, 999_999_999_999, 1_000_000_000_000, 1_003_000_000_000, u64::MAX] {
///     assert!(fast.to_ns(ticks).abs_diff(cal.to_reference_ns(ticks)) <= 1);
/// }
/// assert_eq!(fast.to_ns(1_000_000_000_000 + 3_000_000_000), 6_000_000_000);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FastConverter {
    anchor_ticks: u64,
    /// The domain's valid-bit mask.
    mask: u64,
    anchor_ns: u64,
    near: NearPath,
    general: GeneralPath,
}

/// Two multiplies for the window of ticks `base_ticks ..= base_ticks + window`, where `base_ticks` lies
/// `back` ticks before the anchor: `d = ticks - base_ticks` is never negative, and no result saturates or
/// overflows.
#[derive(Clone, Copy, Debug, PartialEq)]
struct NearPath {
    /// `anchor_ticks - back` (wrapping; `to_ns` masks the difference).
    base_ticks: u64,
    /// `anchor_ns - ceil(back * rate)`.
    base_ns: u64,
    /// How many ticks the window spans.
    window: u64,
    /// How many of them lie before the anchor.
    back: u64,
    /// `b`: the period is `2^b` ticks.
    rem_bits: u32,
    /// `s - f`.
    mult_shift: u32,
    /// `f`: fraction bits of the sum.
    frac_bits: u32,
    rem_mask: u64,
    /// `round(ns per period * 2^f)`.
    ns_per_period: u64,
    /// `round(ns per tick * 2^s)`.
    mult: u64,
    /// `round((ceil(back * rate) - back * rate + 1/2) * 2^f)`: returns from `base_ns` to the anchor's
    /// timeline, plus the half ns that makes the final shift round half up.
    offset: u64,
    /// ns error of `ns_per_period / 2^f` against the exact ns per period.
    err_per_period: f64,
    /// ns error of `mult / 2^s` against the exact ns per tick.
    err_per_tick: f64,
    /// Truncation when shifting the remainder term to `f` bits (0 or `2^-f`) plus the rounding of `offset`.
    err_const: f64,
}

/// Three multiplies for any `|delta|` up to `limit`, the magnitude rounded half up or half down.
#[derive(Clone, Copy, Debug, PartialEq)]
struct GeneralPath {
    /// Largest `|delta|` converted; beyond it the exact result saturates (see [`limit_for`]).
    limit: u64,
    /// `b`: the period is `2^b` ticks.
    rem_bits: u32,
    /// `g - q`.
    period_frac_shift: u32,
    /// `s - q`.
    mult_shift: u32,
    /// `q`: fraction bits of the sub-ns sum.
    sum_bits: u32,
    rem_mask: u64,
    /// Integer ns per period.
    ns_per_period: u64,
    /// Fraction of ns per period, `g` bits.
    ns_per_period_frac: u64,
    /// `round(ns per tick * 2^s)`.
    mult: u64,
    /// `2^(q-1)`: half a ns in the sub-ns sum.
    half: u64,
    /// ns error of `ns_per_period + ns_per_period_frac / 2^g` against the exact ns per period.
    err_per_period: f64,
    /// ns error of `mult / 2^s` against the exact ns per tick.
    err_per_tick: f64,
    /// Truncation of the period fraction term when shifted to `q` bits (0 or `2^-q`).
    err_trunc_period: f64,
    /// Truncation of the remainder term when shifted to `q` bits (0 or `2^-q`).
    err_trunc_rem: f64,
}

/// `rate_q64 * 2^k / 2^64`, rounded to nearest (`round`) or down, and the absolute error
/// `|result * 2^(64-k) - rate_q64|` (in units of 2^-64 ns per tick), or `None` when it does not fit in u128.
fn scale_rate(rate_q64: u128, k: u32, round: bool) -> Option<(u128, u128)> {
    if k >= 64 {
        let up = k - 64;
        if up >= 128 || rate_q64.leading_zeros() < up {
            return None;
        }
        Some((rate_q64 << up, 0))
    } else {
        let down = 64 - k; // 1..=64
                           // rate_q64 < 2^127 (ClockCalibration's invariant), so adding half an ulp cannot overflow.
        let half_ulp = if round { 1u128 << (down - 1) } else { 0 };
        let value = (rate_q64 + half_ulp) >> down;
        let err = (value << down).abs_diff(rate_q64);
        Some((value, err))
    }
}

/// The largest `s <= 63` for which `round(rate * 2^s)` (or, failing that, the value rounded down) times
/// `r_max` fits 64 bits: `(mult, s, error in 2^-64 ns per tick)`.
fn largest_mult(rate_q64: u128, r_max: u64) -> Option<(u64, u32, u128)> {
    let fits = |s: u32| {
        [true, false].into_iter().find_map(|round| {
            let (value, err) = scale_rate(rate_q64, s, round)?;
            (value * (r_max as u128) <= u64::MAX as u128).then_some((value as u64, s, err))
        })
    };
    // Whether it fits only gets harder as s grows: bisect for the last s that fits.
    let mut best = fits(0)?;
    let (mut lo, mut hi) = (0u32, 64u32); // fits(lo); hi is past the range or does not fit
    while lo + 1 < hi {
        let mid = (lo + hi) / 2;
        match fits(mid) {
            Some(found) => {
                best = found;
                lo = mid;
            }
            None => hi = mid,
        }
    }
    Some(best)
}

/// The largest `|delta|` for which the exact `|delta| * rate` is below 2^64 ns; beyond it the exact
/// conversion saturates (to `u64::MAX` after the anchor, to 0 before it), whatever `anchor_ns` is.
fn limit_for(rate_q64: u128) -> u64 {
    // m <= (2^128-1)/rate  <=>  m * rate < 2^128  <=>  m * rate / 2^64 < 2^64.
    (u128::MAX / rate_q64).min(u64::MAX as u128) as u64
}

impl NearPath {
    /// The constants for a window of `window` ticks starting `back` ticks before the anchor, with a period
    /// of `2^b` ticks, or `None` if none fit. `back * rate` must not exceed `anchor_ns`.
    fn new(anchor: (u64, u64), rate_q64: u128, window: u64, back: u64, b: u32) -> Option<NearPath> {
        let rem_mask = (1u64 << b) - 1;
        let p_max = (window >> b) as u128;
        let r_max = window.min(rem_mask);
        let (mult, s, mult_err) = if r_max == 0 {
            (0, 63, 0)
        } else {
            largest_mult(rate_q64, r_max)?
        };
        // back * rate = whole - frac / 2^64 ns, exactly.
        let back_q64 = (back as u128).checked_mul(rate_q64)?;
        let whole = u64::try_from(back_q64.div_ceil(1 << 64)).ok()?;
        let frac = ((whole as u128) << 64) - back_q64; // < 2^64
        let base_ns = anchor.1.checked_sub(whole)?;
        // The sum is about window * rate * 2^f: start from the f that estimate allows and step down.
        let max_ns = (((window as u128) * rate_q64) >> 64) + 3;
        let start = 64u32.saturating_sub(128 - max_ns.leading_zeros()).min(s).min(62);
        (1..=start).rev().find_map(|f| {
            let (period_value, period_err) = scale_rate(rate_q64, b + f, true)?;
            let rem_part = ((r_max as u128) * (mult as u128)) >> (s - f);
            let offset_exact = (frac << f) + (1u128 << (63 + f)); // (frac / 2^64 + 1/2) * 2^f, in units of 2^-64
            let offset = (offset_exact + (1u128 << 63)) >> 64;
            let offset_err = (offset << 64).abs_diff(offset_exact) as f64 * 2f64.powi(-64 - f as i32);
            let sum = p_max * period_value + rem_part + offset;
            let trunc = if r_max > 0 && mult.trailing_zeros() < s - f {
                2f64.powi(-(f as i32))
            } else {
                0.0
            };
            (sum <= u64::MAX as u128).then(|| NearPath {
                base_ticks: anchor.0.wrapping_sub(back),
                base_ns,
                window,
                back,
                rem_bits: b,
                mult_shift: s - f,
                frac_bits: f,
                rem_mask,
                ns_per_period: if p_max == 0 { 0 } else { period_value as u64 },
                mult,
                offset: offset as u64,
                err_per_period: if p_max == 0 {
                    0.0
                } else {
                    period_err as f64 * 2f64.powi(b as i32 - 64)
                },
                err_per_tick: mult_err as f64 * 2f64.powi(-64),
                err_const: trunc + offset_err,
            })
        })
    }

    /// Bound on the error before rounding for ticks at most `m` from the anchor (and in the window).
    fn approx_error(&self, m: u64) -> f64 {
        let d = m.saturating_add(self.back).min(self.window);
        let rem = d.min(self.rem_mask);
        (d >> self.rem_bits) as f64 * self.err_per_period + rem as f64 * self.err_per_tick + self.err_const
    }

    /// `round(d * rate - back * rate) + ceil(back * rate)`, for `d <= window`.
    #[inline(always)]
    fn ns(&self, d: u64) -> u64 {
        let periods = d >> self.rem_bits;
        let rem = d & self.rem_mask;
        (periods * self.ns_per_period + ((rem * self.mult) >> self.mult_shift) + self.offset) >> self.frac_bits
    }
}

impl GeneralPath {
    /// The constants for magnitudes up to `limit` with a period of `2^b` ticks, or `None` if they do not fit.
    ///
    /// The error terms are exact bounds: `err_per_period` and `err_per_tick` are the rounding errors of the
    /// scaled rates, truncations are bounded by `2^-q` each.
    fn new(rate_q64: u128, limit: u64, b: u32) -> Option<GeneralPath> {
        let rem_mask = (1u64 << b) - 1;
        let p_max = limit >> b;
        let r_max = limit.min(rem_mask);

        // Period term: p * (ns_per_period + ns_per_period_frac / 2^g), with p * ns_per_period_frac < 2^64.
        // g: the most fraction bits with p_max * (2^g - 1) < 2^64, i.e. p_max <= 2^(64-g) (capped at 63).
        let g = (p_max > 0).then(|| (p_max - 1).leading_zeros().min(63));
        let (mut ns_per_period, mut ns_per_period_frac, mut err_per_period) = (0, 0, 0.0);
        if let Some(g) = g {
            // Rounded to nearest, or down where rounding up would overflow the integer product for some
            // p <= p_max (only for huge rates, whose exact product comes within a period of 2^64 ns).
            let (value, err, whole) = [true, false].into_iter().find_map(|round| {
                let (value, err) = scale_rate(rate_q64, b + g, round)?;
                let whole = u64::try_from(value >> g).ok()?;
                ((p_max as u128) * (whole as u128) <= u64::MAX as u128).then_some((value, err, whole))
            })?;
            ns_per_period = whole;
            ns_per_period_frac = (value & ((1u128 << g) - 1)) as u64;
            err_per_period = err as f64 * 2f64.powi(b as i32 - 64);
        }

        // Remainder term: (r * mult) >> s with the largest s for which r * mult fits.
        let (mult, s, err_per_tick) = if r_max == 0 {
            (0, None, 0.0)
        } else {
            let (mult, s, err) = largest_mult(rate_q64, r_max)?;
            (mult, Some(s), err as f64 * 2f64.powi(-64))
        };

        // Fraction bits of the sum: as many as let the largest sub-ns sum (plus one half) fit.
        let q_max = g
            .unwrap_or(MAX_SUM_FRAC_BITS)
            .min(s.unwrap_or(MAX_SUM_FRAC_BITS))
            .min(MAX_SUM_FRAC_BITS);
        let q = (1..=q_max).rev().find(|&q| {
            let period_part = g.map_or(0, |g| ((p_max as u128) * (ns_per_period_frac as u128)) >> (g - q));
            let rem_part = s.map_or(0, |s| ((r_max as u128) * (mult as u128)) >> (s - q));
            period_part + rem_part + (1u128 << (q - 1)) <= u64::MAX as u128
        })?;
        // Shifting a product down to q bits truncates (by less than 2^-q ns), unless the bits shifted out
        // are always zero.
        let trunc = 2f64.powi(-(q as i32));
        Some(GeneralPath {
            limit,
            rem_bits: b,
            period_frac_shift: g.map_or(0, |g| g - q),
            mult_shift: s.map_or(0, |s| s - q),
            sum_bits: q,
            rem_mask,
            ns_per_period,
            ns_per_period_frac,
            mult,
            half: 1u64 << (q - 1),
            err_per_period,
            err_per_tick,
            err_trunc_period: if g.is_some_and(|g| ns_per_period_frac.trailing_zeros() < g - q) {
                trunc
            } else {
                0.0
            },
            err_trunc_rem: if s.is_some_and(|s| mult.trailing_zeros() < s - q) {
                trunc
            } else {
                0.0
            },
        })
    }

    /// Bound on the error before rounding for magnitudes up to `m`.
    fn approx_error(&self, m: u64) -> f64 {
        let m = m.min(self.limit);
        let periods = m >> self.rem_bits;
        let rem = m.min(self.rem_mask);
        let mut err = periods as f64 * self.err_per_period + rem as f64 * self.err_per_tick;
        if periods > 0 {
            err += self.err_trunc_period;
        }
        if rem > 0 {
            err += self.err_trunc_rem;
        }
        err
    }

    /// `round(m * rate)` for `m <= limit`, as `(periods * ns_per_period, rest)` whose (saturating) sum it is.
    /// `half` is one half ns in the sub-ns sum (round half up) or one unit less (round half down).
    #[inline(always)]
    fn magnitude_parts(&self, m: u64, half: u64) -> (u64, u64) {
        let periods = m >> self.rem_bits;
        let rem = m & self.rem_mask;
        // For m <= limit nothing here overflows (checked in `new`).
        let sub_ns = ((periods * self.ns_per_period_frac) >> self.period_frac_shift)
            + ((rem * self.mult) >> self.mult_shift)
            + half;
        (periods * self.ns_per_period, sub_ns >> self.sum_bits)
    }
}

impl FastConverter {
    /// Precomputes the constants for `cal` (about 0.1 ms: it tries every period `2^b` for both paths and
    /// bisects for the near path's reach). Rebuild the converter whenever the calibration changes.
    ///
    /// Works for any domain width: ticks are measured from the anchor with the same wrap-aware signed delta
    /// as [`ClockCalibration::ticks_from_anchor`], and bits above the valid ones are ignored.
    ///
    /// ```
    /// use tickline::{calibration::{ClockCalibration, ClockDomain}, clock::FastConverter};
    /// // A 36-bit GPU timestamp at 52.08 ns per tick, anchored just before its wrap.
    /// let domain = ClockDomain::new(36, 52.08).unwrap();
    /// let cal = ClockCalibration::from_anchor(domain, domain.mask() - 10, 1_000_000_000, 52.08).unwrap();
    /// let fast = FastConverter::new(&cal);
    /// assert!(fast.to_ns(5).abs_diff(cal.to_reference_ns(5)) <= fast.worst_case_error_ns());
    /// assert!(fast.to_ns(5) > fast.to_ns(domain.mask()));
    /// ```
    pub fn new(cal: &ClockCalibration) -> Self {
        Self::from_parts(
            cal.anchor_ticks(),
            cal.anchor_ns(),
            cal.domain().valid_bits(),
            cal.ns_per_tick_q64(),
        )
    }

    /// [`new`](Self::new) from the calibration's parts: any `rate_q64` in `1..2^127` (a Q64.64 ns per tick).
    fn from_parts(anchor_ticks: u64, anchor_ns: u64, valid_bits: u32, rate_q64: u128) -> Self {
        assert!((1..=64).contains(&valid_bits) && (1..1u128 << 127).contains(&rate_q64));
        let mask = u64::MAX >> (64 - valid_bits);
        let half_domain = 1u64 << (valid_bits - 1);
        let limit = limit_for(rate_q64).min(half_domain);
        let general = (0..64)
            .filter_map(|b| GeneralPath::new(rate_q64, limit, b))
            .min_by(|x, y| x.approx_error(limit).total_cmp(&y.approx_error(limit)))
            // Some period always fits (tested for rates across the whole Q64.64 range): b = 0 whenever
            // the saturation limit is below 2^63 (rates above 1 ns per tick), b around 32 otherwise.
            .expect("no FastConverter period fits the calibration's rate");
        let general_error = general.approx_error(limit);

        // The near window reaches `back` ticks before the anchor (an eighth of it, as long as that costs no
        // saturation at 0) and the rest after it, where the exact delta * rate plus at most 3 ns of
        // approximation, rounding and offset must stay at most u64::MAX - anchor_ns (it adds without
        // saturating). Both sides stay within half the domain, where the masked difference is unambiguous.
        let anchor = (anchor_ticks & mask, anchor_ns);
        let headroom = (u64::MAX - anchor_ns).saturating_sub(3) as u128;
        let ahead_max = (((headroom << 64) / rate_q64).min(u64::MAX as u128) as u64)
            .min(limit)
            .min(half_domain - 1);
        let back_max = ((((anchor_ns as u128) << 64) / rate_q64).min(u64::MAX as u128) as u64).min(half_domain);
        let window_max = ahead_max.saturating_add((ahead_max / 7).min(back_max));
        let target = general_error.max(NEAR_ERROR_NS);
        let best_near = |window: u64| {
            let back = (window / 8).min(back_max);
            if window - back > ahead_max {
                return None;
            }
            (0..64)
                .filter_map(|b| NearPath::new(anchor, rate_q64, window, back, b))
                .min_by(|x, y| x.approx_error(u64::MAX).total_cmp(&y.approx_error(u64::MAX)))
                .filter(|near| near.approx_error(u64::MAX) * (1.0 + BOUND_SLACK) <= target.min(0.5))
        };
        // The longest window (up to window_max) whose bound meets the target: bisection on its bit length,
        // then eight more steps on its value. (A longer window leaves fewer fraction bits: a larger bound.)
        let near = best_near(window_max).unwrap_or_else(|| {
            let mut found = best_near(0).expect("the near path always fits an empty window");
            let (mut lo, mut hi) = (0u64, window_max); // best_near(lo) fits, best_near(hi) does not
            let mut bits = (0u32, 64 - window_max.leading_zeros());
            while bits.0 + 1 < bits.1 {
                let mid = (bits.0 + bits.1) / 2;
                match best_near((1u64 << mid) - 1) {
                    Some(near) => (found, lo, bits.0) = (near, (1u64 << mid) - 1, mid),
                    None => (hi, bits.1) = ((1u64 << mid) - 1, mid),
                }
            }
            for _ in 0..8 {
                let mid = lo + (hi - lo) / 2;
                match best_near(mid) {
                    Some(near) => (found, lo) = (near, mid),
                    None => hi = mid,
                }
            }
            found
        });
        FastConverter {
            anchor_ticks: anchor_ticks & mask,
            mask,
            anchor_ns,
            near,
            general,
        }
    }

    /// Converts source ticks to reference ns: [`ClockCalibration::to_reference_ns`] to within
    /// [`worst_case_error_ns`](Self::worst_case_error_ns), with u64 multiplies, shifts and adds.
    ///
    /// ```
    /// use tickline::{calibration::{ClockCalibration, ClockDomain}, clock::FastConverter};
    /// let cal = ClockCalibration::from_anchor(ClockDomain::new(64, 1.0).unwrap(), 1_000, 2_000, 1.0).unwrap();
    /// let fast = FastConverter::new(&cal);
    /// assert_eq!(fast.to_ns(1_500), 2_500);
    /// assert_eq!(fast.to_ns(0), 1_000);
    /// assert_eq!(fast.to_ns(1_000u64.wrapping_sub(5_000)), 0); // before the reference clock's zero: saturates
    /// ```
    #[inline]
    pub fn to_ns(&self, ticks: u64) -> u64 {
        let d = ticks.wrapping_sub(self.near.base_ticks) & self.mask;
        if d <= self.near.window {
            // Cannot overflow: the window leaves room for its largest result.
            self.near.base_ns + self.near.ns(d)
        } else {
            self.general_ns(ticks)
        }
    }

    /// Ticks outside the near window.
    #[inline(never)]
    fn general_ns(&self, ticks: u64) -> u64 {
        // Wrap-aware signed distance from the anchor, as `ClockDomain::delta_ticks` computes it.
        let d = ticks.wrapping_sub(self.anchor_ticks) & self.mask;
        let sign_shift = self.mask.leading_zeros();
        let delta = ((d << sign_shift) as i64) >> sign_shift;
        let m = delta.unsigned_abs();
        let g = &self.general;
        if delta < 0 {
            if m > g.limit {
                return 0;
            }
            // Exact: anchor_ns + floor(-x + 1/2) = anchor_ns - ceil(x - 1/2): round the magnitude half down.
            let (whole, rest) = g.magnitude_parts(m, g.half - 1);
            self.anchor_ns.saturating_sub(whole.saturating_add(rest))
        } else {
            if m > g.limit {
                return u64::MAX;
            }
            let (whole, rest) = g.magnitude_parts(m, g.half);
            self.anchor_ns.saturating_add(whole.saturating_add(rest))
        }
    }

    /// Converts every tick of `ticks` into `out` (of the same length).
    ///
    /// ```
    /// use tickline::{calibration::{ClockCalibration, ClockDomain}, clock::FastConverter};
    /// let cal = ClockCalibration::from_anchor(ClockDomain::new(64, 0.5).unwrap(), 0, 0, 0.5).unwrap();
    /// let mut out = [0; 3];
    /// FastConverter::new(&cal).convert_slice(&[2, 4, 7], &mut out);
    /// assert_eq!(out, [1, 2, 4]);
    /// ```
    ///
    /// # Panics
    ///
    /// If `ticks` and `out` differ in length.
    pub fn convert_slice(&self, ticks: &[u64], out: &mut [u64]) {
        assert_eq!(ticks.len(), out.len(), "convert_slice: input and output lengths differ");
        for (ns, &t) in out.iter_mut().zip(ticks) {
            *ns = self.to_ns(t);
        }
    }

    /// The ticks the two-multiply near path converts, as `(first, last)` distances from the anchor
    /// (`first` before it, `last` after it); all others take the three-multiply general path.
    ///
    /// ```
    /// use tickline::{calibration::{ClockCalibration, ClockDomain}, clock::FastConverter};
    /// let tsc = ClockCalibration::from_anchor(ClockDomain::new(64, 0.4).unwrap(), 0, 1 << 40, 0.4).unwrap();
    /// let (before, after) = FastConverter::new(&tsc).near_window();
    /// // Over half an hour after the anchor, and some minutes before it.
    /// assert!(after as f64 * 0.4 > 1800e9 && before as f64 * 0.4 > 240e9);
    /// ```
    pub fn near_window(&self) -> (u64, u64) {
        (self.near.back, self.near.window - self.near.back)
    }

    /// The largest `|to_ns(t) - cal.to_reference_ns(t)|` in ns over every tick `t` whose wrap-aware distance
    /// from the anchor is at most `delta_ticks`: `⌈approx_error_ns(delta_ticks)⌉`, so 1 (or 0 where the
    /// arithmetic is exact, and at the anchor itself, whose exact value is a whole ns that an error below
    /// half a ns cannot round away from).
    ///
    /// ```
    /// use tickline::{calibration::{ClockCalibration, ClockDomain}, clock::FastConverter};
    /// let tsc = ClockCalibration::from_anchor(ClockDomain::new(64, 0.4).unwrap(), 0, 0, 0.4).unwrap();
    /// let fast = FastConverter::new(&tsc);
    /// assert_eq!(fast.max_error_ns(0), 0);
    /// assert_eq!(fast.max_error_ns(1 << 40), 1);
    /// ```
    pub fn max_error_ns(&self, delta_ticks: u64) -> u64 {
        let err = self.approx_error_ns(delta_ticks);
        if delta_ticks == 0 && err < 0.5 {
            0
        } else {
            err.ceil() as u64
        }
    }

    /// The largest `|to_ns(t) - cal.to_reference_ns(t)|` in ns over the whole u64 tick range: 1 for every
    /// `ClockCalibration` rate, 0 for power-of-two rates.
    ///
    /// ```
    /// use tickline::{calibration::{ClockCalibration, ClockDomain}, clock::FastConverter};
    /// let ns_clock = ClockCalibration::from_anchor(ClockDomain::new(64, 1.0).unwrap(), 7, 9, 1.0).unwrap();
    /// assert_eq!(FastConverter::new(&ns_clock).worst_case_error_ns(), 0);
    /// ```
    pub fn worst_case_error_ns(&self) -> u64 {
        self.max_error_ns(u64::MAX)
    }

    /// A bound, in ns, on how far the fast value is from the exact real-valued `anchor_ns ± |delta| * rate`
    /// before rounding to whole ns, for every tick at most `delta_ticks` from the anchor (whichever path
    /// converts it). Beyond the distance at which the exact result saturates, the fast one saturates
    /// identically.
    ///
    /// ```
    /// use tickline::{calibration::{ClockCalibration, ClockDomain}, clock::FastConverter};
    /// let tsc = ClockCalibration::from_anchor(ClockDomain::new(64, 1.0 / 3.0).unwrap(), 0, 0, 1.0 / 3.0).unwrap();
    /// let fast = FastConverter::new(&tsc);
    /// assert!(fast.approx_error_ns(u64::MAX) < 1.0 / 256.0);
    /// ```
    pub fn approx_error_ns(&self, delta_ticks: u64) -> f64 {
        let err = self
            .general
            .approx_error(delta_ticks)
            .max(self.near.approx_error(delta_ticks));
        err * (1.0 + BOUND_SLACK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibration::ClockDomain;
    use proptest::prelude::*;

    fn cal(bits: u32, anchor_ticks: u64, anchor_ns: u64, ns_per_tick: f64) -> ClockCalibration {
        ClockCalibration::from_anchor(
            ClockDomain::new(bits, ns_per_tick).unwrap(),
            anchor_ticks,
            anchor_ns,
            ns_per_tick,
        )
        .unwrap()
    }

    /// Checks one tick against the exact path and the converter's own bound; returns the difference.
    fn check(c: &ClockCalibration, f: &FastConverter, ticks: u64) -> u64 {
        let exact = c.to_reference_ns(ticks);
        let fast = f.to_ns(ticks);
        let diff = fast.abs_diff(exact);
        let dist = c.ticks_from_anchor(ticks).unsigned_abs();
        assert!(
            diff <= f.max_error_ns(dist) && diff <= f.worst_case_error_ns(),
            "ticks {ticks} (|delta| {dist}): fast {fast} exact {exact}, bound {} / {}; {c:?} {f:?}",
            f.max_error_ns(dist),
            f.worst_case_error_ns()
        );
        diff
    }

    const RATES: [f64; 12] = [
        1.0 / 3.0,
        1.0 / 2.4,
        1.0 / 3.7,
        0.2,
        1.0,
        1.0 / 1.0002,
        0.5,
        52.08,
        41.666_666,
        0.01,
        1e5,
        1.0 / 1.999_999_1,
    ];

    fn interesting_ticks(anchor: u64) -> Vec<u64> {
        let mut ticks = vec![0, 1, u64::MAX, u64::MAX - 1, 1 << 63, (1 << 63) - 1, (1 << 63) + 1];
        for k in 0..64 {
            let d = 1u64 << k;
            for off in [d, d - 1, d + 1, d.wrapping_mul(3) / 2] {
                ticks.push(anchor.wrapping_add(off));
                ticks.push(anchor.wrapping_sub(off));
            }
        }
        ticks.push(anchor);
        ticks.push(anchor.wrapping_add(1 << 63)); // the farthest point, i64::MIN from the anchor
        ticks
    }

    #[test]
    fn typical_rates_agree_with_exact_path() {
        for &rate in &RATES {
            for anchor_ticks in [0, 1_000, 123_456_789_012_345, u64::MAX - 5, 1 << 63] {
                for anchor_ns in [0, 5_000_000_000, 1 << 62, u64::MAX - 1_000_000_000_000, u64::MAX] {
                    let c = cal(64, anchor_ticks, anchor_ns, rate);
                    let f = FastConverter::new(&c);
                    assert!(f.worst_case_error_ns() <= 1, "rate {rate}: {}", f.worst_case_error_ns());
                    for t in interesting_ticks(anchor_ticks) {
                        check(&c, &f, t);
                    }
                    // Both edges of the near window, inside and out.
                    let (before, after) = f.near_window();
                    for d in [after / 2, after.saturating_sub(1), after, after.saturating_add(1)] {
                        check(&c, &f, anchor_ticks.wrapping_add(d));
                    }
                    for d in [before / 2, before.saturating_sub(1), before, before.saturating_add(1)] {
                        check(&c, &f, anchor_ticks.wrapping_sub(d));
                    }
                }
            }
        }
    }

    #[test]
    fn power_of_two_rates_are_exact() {
        for rate in [1.0, 0.5, 0.25, 2.0, 64.0, 1.0 / 1024.0] {
            let c = cal(64, 77_777, 1_000_000_000, rate);
            let f = FastConverter::new(&c);
            assert_eq!(f.worst_case_error_ns(), 0, "rate {rate}");
            for t in interesting_ticks(77_777) {
                assert_eq!(f.to_ns(t), c.to_reference_ns(t), "rate {rate} ticks {t}");
            }
        }
    }

    #[test]
    fn tsc_three_days_out_is_exact() {
        // The same case as the exact path's own test: 1/3 ns per tick, 3 days of ticks away.
        let c = cal(64, 1_000, 5_000, 1.0 / 3.0);
        let f = FastConverter::new(&c);
        let three_days_ticks = 3 * 86_400 * 3_000_000_000u64;
        assert_eq!(f.to_ns(1_000 + three_days_ticks), 5_000 + 3 * 86_400 * 1_000_000_000);
        assert_eq!(f.to_ns(1_000 - 3), 4_999);
    }

    #[test]
    fn narrow_domains_wrap_like_the_exact_path() {
        for bits in [1, 2, 20, 36, 48, 63] {
            let c = cal(bits, (1u64 << (bits - 1)) + 3, 10_000_000_000, 52.08);
            let f = FastConverter::new(&c);
            assert!(f.worst_case_error_ns() <= 1);
            let mask = c.domain().mask();
            for t in interesting_ticks(c.anchor_ticks()) {
                check(&c, &f, t);
                // High bits beyond the valid ones are ignored, as by the exact path.
                assert_eq!(f.to_ns(t), f.to_ns(t & mask));
            }
        }
    }

    #[test]
    fn bound_holds_across_rates_from_2_pow_minus_20_to_2_pow_20() {
        let mut rate = 2f64.powi(-20);
        while rate <= 2f64.powi(20) {
            let c = cal(64, 1 << 62, 1 << 50, rate);
            let f = FastConverter::new(&c);
            assert!(f.worst_case_error_ns() <= 1, "rate {rate}: {f:?}");
            // Not vacuous: far below a ns before rounding, at any distance.
            assert!(
                f.approx_error_ns(u64::MAX) <= NEAR_ERROR_NS,
                "rate {rate}: {}",
                f.approx_error_ns(u64::MAX)
            );
            for t in interesting_ticks(1 << 62) {
                check(&c, &f, t);
            }
            rate *= 1.07;
        }
    }

    #[test]
    fn bound_is_not_vacuous_near_the_anchor() {
        let c = cal(64, 1 << 50, 1 << 40, 1.0 / 2.9);
        let f = FastConverter::new(&c);
        assert_eq!(f.max_error_ns(1 << 40), 1);
        assert!(f.approx_error_ns(1 << 40) < 1e-3, "{}", f.approx_error_ns(1 << 40));
        // A TSC's near window reaches past half an hour after the anchor and minutes before it.
        let (before, after) = f.near_window();
        assert!(
            after as f64 / 2.9 > 1800e9 && before as f64 / 2.9 > 240e9,
            "{before} {after}"
        );
        // Almost every conversion within ±2^40 ticks of the anchor is exact.
        let mut off_by_one = 0;
        let n = 200_000u64;
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let t = (1u64 << 50) - (1 << 40) + x % (1 << 41);
            off_by_one += check(&c, &f, t);
        }
        assert!(off_by_one * 1000 < n, "{off_by_one} of {n} off by one");
    }

    #[test]
    fn convert_slice_matches_to_ns() {
        let c = cal(64, 10, 20, 0.3);
        let f = FastConverter::new(&c);
        let ticks: Vec<u64> = (0..100).map(|i| i * 1_000_003).collect();
        let mut out = vec![0; ticks.len()];
        f.convert_slice(&ticks, &mut out);
        for (t, ns) in ticks.iter().zip(&out) {
            assert_eq!(*ns, f.to_ns(*t));
        }
    }

    fn rate_strategy() -> impl Strategy<Value = f64> {
        prop_oneof![
            Just(1.0),
            0.05f64..2000.0,
            0.2f64..1.0,
            (-4.3f64..11.0).prop_map(f64::exp2),
        ]
    }

    fn u64_near_edges() -> impl Strategy<Value = u64> {
        prop_oneof![
            any::<u64>(),
            0u64..1 << 20,
            (0u64..1 << 20).prop_map(|x| u64::MAX - x),
            (0u64..1 << 20).prop_map(|x| (1u64 << 63).wrapping_add(x).wrapping_sub(1 << 19)),
        ]
    }

    fn offset_strategy() -> impl Strategy<Value = u64> {
        // How far the tick lies from the anchor (wrapping: "negative" offsets are huge u64s).
        prop_oneof![
            any::<u64>(),
            (-(1i64 << 20)..1i64 << 20).prop_map(|x| x as u64),
            (-(1i64 << 40)..1i64 << 40).prop_map(|x| x as u64),
            (-(1i64 << 56)..1i64 << 56).prop_map(|x| x as u64),
            (0u64..1 << 20).prop_map(|x| (1u64 << 63).wrapping_add(x).wrapping_sub(1 << 19)),
        ]
    }

    /// The exact conversion for any Q64.64 rate, as `ClockCalibration::to_reference_ns` computes it.
    fn exact_q64(anchor_ticks: u64, anchor_ns: u64, bits: u32, rate_q64: u128, ticks: u64) -> u64 {
        let delta = ClockDomain::new(bits, 1.0).unwrap().delta_ticks(anchor_ticks, ticks) as i128;
        let whole = (rate_q64 >> 64) as i128;
        let frac = (rate_q64 as u64) as i128;
        let ns = anchor_ns as i128 + delta * whole + ((delta * frac + (1i128 << 63)) >> 64);
        ns.clamp(0, u64::MAX as i128) as u64
    }

    #[test]
    fn exact_q64_reference_matches_the_calibration() {
        for &rate in &RATES {
            let c = cal(64, 12_345, 1 << 40, rate);
            for t in interesting_ticks(12_345) {
                assert_eq!(
                    exact_q64(12_345, 1 << 40, 64, c.ns_per_tick_q64(), t),
                    c.to_reference_ns(t)
                );
            }
        }
    }

    #[test]
    fn extreme_q64_rates_build_and_stay_within_their_bound() {
        for exp in 0..127u32 {
            for low in [0u128, 1, u128::MAX, 0x5555_5555_5555_5555_5555_5555_5555_5555] {
                let rate_q64 = (1u128 << exp) | (low & ((1u128 << exp) - 1));
                let f = FastConverter::from_parts(3, 1 << 60, 64, rate_q64);
                assert!(f.worst_case_error_ns() <= 2, "rate_q64 {rate_q64}: {f:?}");
                for t in interesting_ticks(3) {
                    let exact = exact_q64(3, 1 << 60, 64, rate_q64, t);
                    let dist = t.wrapping_sub(3) as i64;
                    assert!(
                        f.to_ns(t).abs_diff(exact) <= f.max_error_ns(dist.unsigned_abs()),
                        "rate_q64 {rate_q64} ticks {t}: {} vs {exact}",
                        f.to_ns(t)
                    );
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn fast_is_within_bound_of_exact_everywhere(
            rate in rate_strategy(),
            anchor_ticks in u64_near_edges(),
            anchor_ns in u64_near_edges(),
            offset in offset_strategy(),
            absolute in u64_near_edges(),
        ) {
            let c = cal(64, anchor_ticks, anchor_ns, rate);
            let f = FastConverter::new(&c);
            prop_assert!(f.worst_case_error_ns() <= 1);
            prop_assert!(f.approx_error_ns(u64::MAX) <= NEAR_ERROR_NS);
            if rate == 1.0 {
                prop_assert_eq!(f.worst_case_error_ns(), 0);
            }
            let (before, after) = f.near_window();
            let edges = [after, after.wrapping_add(1)].map(|d| anchor_ticks.wrapping_add(d));
            let back_edges = [before, before.wrapping_add(1)].map(|d| anchor_ticks.wrapping_sub(d));
            for t in [anchor_ticks.wrapping_add(offset), absolute].into_iter().chain(edges).chain(back_edges) {
                let diff = check(&c, &f, t);
                prop_assert!(diff <= 1);
                let dist = c.ticks_from_anchor(t).unsigned_abs();
                if dist <= 1 << 40 {
                    prop_assert!(diff <= f.max_error_ns(1 << 40));
                    prop_assert!(f.max_error_ns(1 << 40) <= 1);
                }
            }
        }

        #[test]
        fn arbitrary_q64_rates_within_their_bound(
            exp in 0u32..127,
            bits in any::<u128>(),
            anchor_ticks in u64_near_edges(),
            anchor_ns in u64_near_edges(),
            offset in offset_strategy(),
            absolute in u64_near_edges(),
        ) {
            let rate_q64 = (1u128 << exp) | (bits & ((1u128 << exp) - 1));
            let f = FastConverter::from_parts(anchor_ticks, anchor_ns, 64, rate_q64);
            prop_assert!(f.worst_case_error_ns() <= 2);
            for t in [anchor_ticks.wrapping_add(offset), absolute] {
                let exact = exact_q64(anchor_ticks, anchor_ns, 64, rate_q64, t);
                let dist = (t.wrapping_sub(anchor_ticks) as i64).unsigned_abs();
                prop_assert!(f.to_ns(t).abs_diff(exact) <= f.max_error_ns(dist), "{} vs {}", f.to_ns(t), exact);
            }
        }

        #[test]
        fn narrow_domains_within_bound(
            bits in 20u32..64,
            rate in rate_strategy(),
            anchor_ticks in any::<u64>(),
            anchor_ns in u64_near_edges(),
            t in any::<u64>(),
        ) {
            let c = cal(bits, anchor_ticks, anchor_ns, rate);
            let f = FastConverter::new(&c);
            prop_assert!(f.worst_case_error_ns() <= 1);
            check(&c, &f, t);
        }
    }
}
