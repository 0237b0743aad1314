//! Bounded, fair waiting for instances.
//!
//! A request that has to wait for an instance — a cold function's first
//! requests, a retry that asks the controller again, a request queued
//! behind its function's concurrency limit — holds a [`Ticket`] while it
//! waits. Tickets are bounded router-wide (`--max-waiting-requests`) and per
//! function (`--max-waiting-requests-per-function`); a request that gets
//! none is answered `503` with `Retry-After` at once.
//!
//! The router-wide bound is shared max-min fairly: when it is reached, a
//! request of a function holding fewer tickets than the function holding
//! the most (by two or more) takes that function's newest ticket, whose
//! request is answered `503` at once (displaced). So one busy tenant cannot
//! hold every slot, and a burst of first requests for many tenants leaves
//! every tenant at least one waiting request while there are fewer tenants
//! than slots, whatever order the requests arrive in.
//!
//! [`decide`] is the rule, a pure function; [`Admission`] applies it under
//! one lock. Warm requests (an instance with room is at hand) never come
//! here.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::oneshot;

use crate::domain::FunctionId;

/// Bounds on waiting requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Requests waiting at once, router-wide.
    pub total: usize,
    /// Requests of one function waiting at once.
    pub per_function: usize,
}

/// Why a request may not wait. `Display` is the body of the `503`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("{bound} requests are already waiting for instances on this router (--max-waiting-requests)")]
    RouterFull { bound: usize },
    #[error(
        "{bound} requests of this function are already waiting for an instance (--max-waiting-requests-per-function)"
    )]
    FunctionFull { bound: usize },
    #[error("requests of other functions took this request's place among those waiting for instances")]
    Displaced,
}

impl Refused {
    /// The `reason` label of `skipper_router_requests_refused_total`.
    #[must_use]
    pub fn reason(self) -> &'static str {
        match self {
            Self::RouterFull { .. } => "router_waiting_full",
            Self::FunctionFull { .. } => "function_waiting_full",
            Self::Displaced => "displaced",
        }
    }
}

/// What to do with a request that wants to wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision<K> {
    /// It waits.
    Admit,
    /// It waits in place of the newest waiting request of function `K`.
    Displace(K),
    /// It is answered at once.
    Refuse(Refused),
}

/// The admission rule. `total` requests wait, `mine` of them for the
/// request's own function; `largest` is the function with the most waiting
/// requests and their number (looked at only when the router is full).
pub fn decide<K>(
    limits: Limits,
    total: usize,
    mine: usize,
    largest: impl FnOnce() -> Option<(K, usize)>,
) -> Decision<K> {
    if mine >= limits.per_function {
        return Decision::Refuse(Refused::FunctionFull {
            bound: limits.per_function,
        });
    }
    if total < limits.total {
        return Decision::Admit;
    }
    match largest() {
        Some((k, n)) if n > mine + 1 => Decision::Displace(k),
        _ => Decision::Refuse(Refused::RouterFull { bound: limits.total }),
    }
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    displace: oneshot::Sender<()>,
}

#[derive(Debug, Default)]
struct State {
    total: usize,
    next_id: u64,
    /// Waiting requests per function, oldest first; a function without
    /// any has no entry.
    functions: HashMap<FunctionId, VecDeque<Waiter>>,
}

impl State {
    /// The function with the most waiting requests (ties: the one whose
    /// newest request came last, so displacement takes the newest
    /// request of all).
    fn largest(&self) -> Option<(FunctionId, usize)> {
        self.functions
            .iter()
            .max_by_key(|(_, q)| (q.len(), q.back().map_or(0, |w| w.id)))
            .map(|(k, q)| (*k, q.len()))
    }
}

#[derive(Debug)]
struct Shared {
    limits: Limits,
    /// A std mutex: every critical section is a few map and queue
    /// operations (a scan of the waiting functions only when the router is
    /// full), never across an await.
    state: Mutex<State>,
    waiting: Gauge,
}

/// The router's waiting requests. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Admission {
    shared: Arc<Shared>,
}

/// One request's place among the waiting ones; dropping it leaves.
#[derive(Debug)]
pub struct Ticket {
    shared: Arc<Shared>,
    function: FunctionId,
    id: u64,
    displaced: oneshot::Receiver<()>,
}

impl Admission {
    /// Waiting bounded by `limits`; `waiting` follows the number of
    /// waiting requests.
    #[must_use]
    pub fn new(limits: Limits, waiting: Gauge) -> Self {
        Self {
            shared: Arc::new(Shared {
                limits,
                state: Mutex::default(),
                waiting,
            }),
        }
    }

    /// The bounds.
    #[must_use]
    pub fn limits(&self) -> Limits {
        self.shared.limits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        lock(&self.shared)
    }

    /// A place for a request of `function` to wait, if [`decide`] gives
    /// one (another function's newest request may be displaced for it).
    ///
    /// # Errors
    /// [`Refused`] when the request is answered at once.
    pub fn enter(&self, function: FunctionId) -> Result<Ticket, Refused> {
        let mut s = self.lock();
        let mine = s.functions.get(&function).map_or(0, VecDeque::len);
        let total = s.total;
        match decide(self.shared.limits, total, mine, || s.largest()) {
            Decision::Refuse(r) => return Err(r),
            Decision::Admit => {
                s.total += 1;
                self.shared.waiting.inc();
            }
            Decision::Displace(victim) => {
                // The victim has at least two waiting requests: its entry stays.
                if let Some(q) = s.functions.get_mut(&victim)
                    && let Some(w) = q.pop_back()
                {
                    let _ = w.displace.send(());
                }
            }
        }
        s.next_id += 1;
        let id = s.next_id;
        let (tx, rx) = oneshot::channel();
        s.functions
            .entry(function)
            .or_default()
            .push_back(Waiter { id, displace: tx });
        Ok(Ticket {
            shared: self.shared.clone(),
            function,
            id,
            displaced: rx,
        })
    }

    /// Requests waiting now.
    #[must_use]
    pub fn waiting(&self) -> usize {
        self.lock().total
    }

    /// Functions with waiting requests now.
    #[must_use]
    pub fn functions(&self) -> usize {
        self.lock().functions.len()
    }

    /// Waiting requests of `function` now.
    #[must_use]
    pub fn waiting_for(&self, function: FunctionId) -> usize {
        self.lock().functions.get(&function).map_or(0, VecDeque::len)
    }
}

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, State> {
    // Poisoning needs a panic inside a map operation, which cannot happen.
    shared
        .state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Ticket {
    /// Completes when a request of another function took this one's
    /// place; the request is then answered [`Refused::Displaced`].
    pub async fn displaced(&mut self) {
        if (&mut self.displaced).await.is_err() {
            // The sender lives as long as the ticket is listed.
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut s = lock(&self.shared);
        let Some(q) = s.functions.get_mut(&self.function) else {
            return;
        };
        // Not found: it was displaced (its place went to another request).
        let Some(pos) = q.iter().position(|w| w.id == self.id) else {
            return;
        };
        q.remove(pos);
        if q.is_empty() {
            s.functions.remove(&self.function);
        }
        s.total -= 1;
        self.shared.waiting.dec();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const LIMITS: Limits = Limits {
        total: 4,
        per_function: 3,
    };

    #[test]
    fn the_rule_as_a_table() {
        let r = |total, mine, largest: Option<(char, usize)>| decide(LIMITS, total, mine, || largest);
        // (total, mine, largest, decision)
        type Case = (usize, usize, Option<(char, usize)>, Decision<char>);
        let cases: &[Case] = &[
            (0, 0, None, Decision::Admit),
            (3, 2, Some(('a', 2)), Decision::Admit),
            // The function's own bound comes first, even with room left.
            (
                1,
                3,
                Some(('a', 3)),
                Decision::Refuse(Refused::FunctionFull { bound: 3 }),
            ),
            // Full: the largest gives up its newest when it holds two more.
            (4, 0, Some(('b', 3)), Decision::Displace('b')),
            (4, 1, Some(('b', 3)), Decision::Displace('b')),
            (4, 0, Some(('b', 2)), Decision::Displace('b')),
            // ... not when shares would only swap.
            (
                4,
                1,
                Some(('b', 2)),
                Decision::Refuse(Refused::RouterFull { bound: 4 }),
            ),
            (
                4,
                0,
                Some(('b', 1)),
                Decision::Refuse(Refused::RouterFull { bound: 4 }),
            ),
        ];
        for &(total, mine, largest, want) in cases {
            assert_eq!(
                r(total, mine, largest),
                want,
                "total {total} mine {mine} largest {largest:?}"
            );
        }
    }

    fn f(n: u64) -> FunctionId {
        FunctionId(n)
    }

    #[tokio::test]
    async fn tickets_count_while_held_and_the_newest_of_the_largest_is_displaced() {
        let gauge = Gauge::default();
        let a = Admission::new(LIMITS, gauge.clone());
        let first = a.enter(f(1)).unwrap();
        let mut second = a.enter(f(1)).unwrap();
        let mut third = a.enter(f(1)).unwrap();
        assert_eq!(a.enter(f(1)).unwrap_err(), Refused::FunctionFull { bound: 3 });
        let other = a.enter(f(2)).unwrap();
        assert_eq!((a.waiting(), gauge.get()), (4, 4));
        // Full: function 3 takes function 1's newest place.
        let newcomer = a.enter(f(3)).unwrap();
        tokio::time::timeout(Duration::from_secs(1), third.displaced())
            .await
            .expect("the newest request of the largest function is told at once");
        assert_eq!(a.waiting_for(f(1)), 2);
        assert_eq!(a.waiting(), 4, "the place changed hands");
        // (2, 1, 1): a fourth function takes function 1's newest place too.
        let fourth = a.enter(f(4)).unwrap();
        tokio::time::timeout(Duration::from_secs(1), second.displaced())
            .await
            .expect("displaced at once");
        // Shares are even now (1, 1, 1, 1): a fifth function is refused.
        assert_eq!(a.enter(f(5)).unwrap_err(), Refused::RouterFull { bound: 4 });
        drop((third, second));
        assert_eq!(a.waiting(), 4, "a displaced ticket holds nothing");
        drop((other, newcomer, fourth));
        assert_eq!(a.waiting(), 1);
        let mut first = first;
        assert!(
            tokio::time::timeout(Duration::from_millis(1), first.displaced())
                .await
                .is_err(),
            "a waiting request is not displaced without cause"
        );
        drop(first);
        assert_eq!(
            (a.waiting(), a.functions(), gauge.get()),
            (0, 0, 0),
            "nothing is left behind"
        );
    }

    #[tokio::test]
    async fn a_burst_in_any_order_leaves_every_function_a_place() {
        let a = Admission::new(
            Limits {
                total: 64,
                per_function: 64,
            },
            Gauge::default(),
        );
        let mut held = Vec::new();
        // 40 functions, 8 requests each, one function after the other.
        for func in 0..40 {
            for _ in 0..8 {
                if let Ok(t) = a.enter(f(func)) {
                    held.push(t);
                }
            }
        }
        held.retain_mut(|t| t.displaced.try_recv().is_err());
        assert_eq!(held.len(), 64);
        let mut per = HashMap::new();
        for t in &held {
            *per.entry(t.function).or_insert(0) += 1;
        }
        assert_eq!(per.len(), 40, "every function keeps a place");
        assert!(per.values().all(|n| (1..=2).contains(n)), "{per:?}");
    }
}
