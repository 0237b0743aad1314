//! Instance counts over the last minutes, per function and for the whole
//! cluster, for the pages' charts.
//!
//! A series stores a point only when the counts change (a step function),
//! so an idle function costs one point. Bounds: points older than the
//! window are dropped except the one in force at its start, a series keeps
//! at most [`MAX_POINTS`], and at most [`MAX_SERIES`] functions are tracked
//! (a function without a sample for a whole window is forgotten).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use crate::domain::FunctionId;

/// Most points one series keeps.
pub const MAX_POINTS: usize = 240;
/// Most functions tracked.
pub const MAX_SERIES: usize = 10_000;

/// Counts from one sample (`at` in seconds since the epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Point {
    pub at: u64,
    pub ready: u16,
    pub total: u16,
}

/// One step function.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    points: VecDeque<Point>,
    /// When the series was last sampled (seconds since the epoch).
    seen: u64,
}

impl Series {
    /// The points, oldest first.
    #[must_use]
    pub fn points(&self) -> &VecDeque<Point> {
        &self.points
    }

    /// Records counts at `at`: a point when they differ from the last one.
    pub fn record(&mut self, at: u64, ready: u16, total: u16, window: Duration) {
        self.seen = at;
        let changed = self
            .points
            .back()
            .is_none_or(|p| (p.ready, p.total) != (ready, total));
        if changed {
            self.points.push_back(Point { at, ready, total });
        }
        let start = at.saturating_sub(window.as_secs());
        // Keep the last point at or before the window's start: the value in
        // force there.
        while self.points.len() > 1 && self.points[1].at <= start {
            self.points.pop_front();
        }
        while self.points.len() > MAX_POINTS {
            self.points.pop_front();
        }
    }
}

/// Every series.
#[derive(Debug, Clone, Default)]
pub struct History {
    pub functions: HashMap<FunctionId, Series>,
    pub totals: Series,
    pub window: Duration,
}

impl History {
    /// An empty history covering `window`.
    #[must_use]
    pub fn new(window: Duration) -> Self {
        Self {
            functions: HashMap::new(),
            totals: Series::default(),
            window,
        }
    }

    /// Records one sample of every function (`(id, ready, total)`) and the
    /// totals, then forgets functions not sampled for a whole window.
    pub fn sample(&mut self, at: u64, counts: &[(FunctionId, usize, usize)]) {
        let clamp = |n: usize| u16::try_from(n).unwrap_or(u16::MAX);
        let window = self.window;
        let (mut ready, mut total) = (0usize, 0usize);
        for &(id, r, t) in counts {
            ready += r;
            total += t;
            if !self.functions.contains_key(&id) && self.functions.len() >= MAX_SERIES {
                continue;
            }
            self.functions
                .entry(id)
                .or_default()
                .record(at, clamp(r), clamp(t), window);
        }
        self.totals.record(at, clamp(ready), clamp(total), window);
        let cutoff = at.saturating_sub(window.as_secs());
        self.functions.retain(|_, s| s.seen > cutoff);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_secs(900);

    #[test]
    fn a_series_stores_changes_and_the_value_at_the_window_start() {
        let mut s = Series::default();
        for t in 0..100 {
            s.record(t * 5, 1, 1, W);
        }
        assert_eq!(s.points().len(), 1, "no change, one point");
        s.record(600, 1, 2, W);
        s.record(605, 2, 2, W);
        s.record(2000, 2, 2, W);
        let at: Vec<u64> = s.points().iter().map(|p| p.at).collect();
        assert_eq!(
            at,
            vec![605],
            "older points than the value in force at 2000-900 are dropped"
        );
        s.record(2005, 0, 0, W);
        assert_eq!(s.points().len(), 2);
    }

    #[test]
    fn a_series_is_bounded_in_points() {
        let mut s = Series::default();
        for t in 0..1000u16 {
            s.record(u64::from(t), t % 2, 1, Duration::from_secs(10_000));
        }
        assert_eq!(s.points().len(), MAX_POINTS);
    }

    #[test]
    fn history_forgets_idle_functions_and_caps_series() {
        let mut h = History::new(W);
        h.sample(0, &[(FunctionId(1), 1, 1), (FunctionId(2), 0, 1)]);
        assert_eq!(h.totals.points().back().map(|p| (p.ready, p.total)), Some((1, 2)));
        h.sample(1000, &[(FunctionId(2), 1, 1)]);
        assert!(
            !h.functions.contains_key(&FunctionId(1)),
            "not sampled for a window"
        );
        assert!(h.functions.contains_key(&FunctionId(2)));
        let many: Vec<_> = (0..(MAX_SERIES as u64 + 50))
            .map(|i| (FunctionId(i), 0, 0))
            .collect();
        h.sample(1005, &many);
        assert_eq!(h.functions.len(), MAX_SERIES);
    }
}
