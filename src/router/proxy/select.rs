//! Choosing the instance of one attempt: the function's local table while
//! its stream is live (queueing while every instance is at the function's
//! concurrency limit), else a `GetInstance` call — one shared by the
//! requests of a cold function.

use std::sync::Arc;

use futures::FutureExt as _;
use tokio::time::Instant;
use tracing::Instrument as _;

use super::admission::{Admission, Refused, Ticket};
use super::{Error, Proxy, Release, Tries};
use crate::api;
use crate::domain::FunctionId;
use crate::router::activity::InFlightGuard;
use crate::router::entry::Parsed;
use crate::router::instances::{BadInstance, Choice, ColdAnswer, Slot, SlotGuard, Table, Wake};
use crate::router::metrics::Series;

/// The instance of one attempt.
#[derive(Debug)]
pub(super) struct Chosen {
    pub slot: Arc<Slot>,
    /// The request counted on the table's slot for this instance.
    pub guard: Option<SlotGuard>,
    /// A oneshot instance, released when dropped.
    pub release: Option<Box<Release>>,
}

/// What selection produced.
#[derive(Debug)]
pub(super) enum Selected {
    Instance(Chosen),
    /// The controller named an instance the router cannot use: exclude it.
    Unusable {
        name: String,
        failure: Error,
    },
    /// No instance this time; another attempt may get one.
    Retry(Error),
    /// The controllers' considered answer, or the request may not wait:
    /// no attempt can change it.
    Final(Error),
}

/// How a wait in the function's queue ended without an instance.
enum Unqueued {
    /// The table has nothing for the request any more: choose again.
    Reselect,
    Final(Error),
}

impl Tries {
    /// Takes the request's place among the waiting ones, unless it holds
    /// one already.
    fn wait(&mut self, admission: &Admission, function: FunctionId) -> Result<(), Refused> {
        if self.ticket.is_none() {
            self.ticket = Some(admission.enter(function)?);
        }
        Ok(())
    }
}

/// Completes when the request's place was given to another's.
async fn displaced(ticket: &mut Option<Ticket>) {
    match ticket {
        Some(t) => t.displaced().await,
        None => std::future::pending().await,
    }
}

impl Proxy {
    /// An instance for the next attempt (see the module docs of
    /// [`super`]). Asking the controller after a failed attempt first
    /// waits the retry policy's back-off.
    pub(super) async fn select(
        &self,
        parsed: &Parsed,
        in_flight: &InFlightGuard,
        tries: &mut Tries,
    ) -> Selected {
        let table = in_flight.table();
        let oneshot = parsed.function.is_oneshot();
        let scale = parsed.function.scale.as_ref();
        let max = scale.map_or(0, crate::domain::Scale::max_instances).max(1) as usize;
        let limit = scale.map_or(0, crate::domain::Scale::max_in_flight_requests);
        loop {
            if !oneshot {
                match table.choose(max, limit, &tries.excluded) {
                    Choice::Chosen(guard) => return chosen(guard),
                    Choice::Full => match self.queue(parsed, table, max, limit, tries).await {
                        Ok(guard) => return chosen(guard),
                        Err(Unqueued::Reselect) => {
                            if table.is_live() {
                                continue;
                            }
                        }
                        Err(Unqueued::Final(e)) => return Selected::Final(e),
                    },
                    Choice::Empty => {}
                }
            }
            let instance = match self.ask(parsed, table, in_flight.entry().series(), tries).await {
                Ok(i) => i,
                Err(s) => return s,
            };
            if oneshot {
                let release = Release {
                    client: self.client.clone(),
                    instance: Box::new(instance.clone()),
                    tracker: self.tracker.clone(),
                    metrics: self.metrics.clone(),
                    span: tracing::Span::current(),
                };
                return match Slot::new(&instance) {
                    Ok(slot) => Selected::Instance(Chosen {
                        slot: Arc::new(slot),
                        guard: None,
                        release: Some(Box::new(release)),
                    }),
                    Err(bad) => unusable(bad),
                };
            }
            // Counted on the table's slot for the instance (its own when the
            // stream listed it), so local choices, the limit and idle
            // reports see this request too.
            let slot = match table.adopt(&instance) {
                Ok(s) => s,
                Err(bad) => return unusable(bad),
            };
            if let Some(guard) = table.count_named(&slot, limit) {
                return chosen(guard);
            }
            match self.queue(parsed, table, max, limit, tries).await {
                Ok(guard) => return chosen(guard),
                Err(Unqueued::Reselect) => {}
                Err(Unqueued::Final(e)) => return Selected::Final(e),
            }
        }
    }

    /// Waits in the function's queue for room under `limit`, at most the
    /// `GetInstance` timeout.
    async fn queue(
        &self,
        parsed: &Parsed,
        table: &Arc<Table>,
        max: usize,
        limit: u32,
        tries: &mut Tries,
    ) -> Result<SlotGuard, Unqueued> {
        if let Err(r) = tries.wait(&self.admission, parsed.id) {
            return Err(Unqueued::Final(self.refused(r)));
        }
        let mut queued = table.enqueue(max, limit, &tries.excluded);
        let timeout = self.settings.get_instance_timeout;
        tokio::select! {
            w = queued.woken() => match w {
                Wake::Chosen(g) => Ok(g),
                Wake::Reselect => Err(Unqueued::Reselect),
            },
            () = displaced(&mut tries.ticket) => Err(Unqueued::Final(self.refused(Refused::Displaced))),
            () = tokio::time::sleep(timeout) => Err(Unqueued::Final(Error::NoRoom { limit, timeout })),
        }
    }

    fn refused(&self, r: Refused) -> Error {
        self.metrics.refused(r.reason());
        Error::Overloaded(r)
    }

    /// An instance from the controller: after the back-off when an attempt
    /// failed before, one call shared with the function's other first
    /// requests when nothing is excluded. The request waits with a
    /// [`Ticket`].
    async fn ask(
        &self,
        parsed: &Parsed,
        table: &Arc<Table>,
        series: &Series,
        tries: &mut Tries,
    ) -> Result<api::Instance, Selected> {
        let backoff = tries.last.is_some().then(|| {
            tries.controller_retries += 1;
            self.settings
                .retry
                .delay(tries.controller_retries, rand::random())
        });
        let shared = !parsed.function.is_oneshot() && tries.excluded.is_empty();
        let req = api::GetInstanceRequest {
            function: Some(parsed.api.clone()),
            exclude_instance_names: tries.excluded.clone(),
        };
        if let Err(r) = tries.wait(&self.admission, parsed.id) {
            return Err(Selected::Final(self.refused(r)));
        }
        let t0 = Instant::now();
        let call = async {
            if let Some(wait) = backoff {
                tokio::time::sleep(wait).await;
            }
            if shared {
                table.cold_call(|| self.get_instance(req)).await
            } else {
                self.get_instance(req).await
            }
        };
        let got = tokio::select! {
            got = call => got,
            () = displaced(&mut tries.ticket) => return Err(Selected::Final(self.refused(Refused::Displaced))),
        };
        let took = t0.elapsed();
        tries.get_instance_time += took;
        series.get_instance_duration().observe(took.as_secs_f64());
        let got = got.map(|(r, timing)| {
            if timing.is_some() {
                tries.timing = timing;
            }
            r
        });
        match got.map(|r| r.instance) {
            Ok(Some(i)) => Ok(i),
            Ok(None) => Err(Selected::Retry(Error::NoInstance)),
            Err(e) => {
                tracing::debug!(error = %e, "failed to get instance for function");
                let every_controller_refuses = crate::client::is_credentials_refusal(e.code())
                    && self.client.endpoints().refusal().is_some();
                Err(if Error::is_final_get_instance(&e) || every_controller_refuses {
                    // Another controller gives the same answer: no retry helps.
                    Selected::Final(Error::from_get_instance(e))
                } else {
                    Selected::Retry(Error::from_get_instance(e))
                })
            }
        }
    }

    /// One `GetInstance` call, in the current span.
    fn get_instance(&self, req: api::GetInstanceRequest) -> futures::future::BoxFuture<'static, ColdAnswer> {
        self.metrics.controller_call("GetInstance");
        let client = self.client.clone();
        let timeout = self.settings.get_instance_timeout;
        async move { client.get_instance_once_timed(req, timeout).await }
            .instrument(tracing::Span::current())
            .boxed()
    }
}

fn chosen(guard: SlotGuard) -> Selected {
    Selected::Instance(Chosen {
        slot: guard.slot().clone(),
        guard: Some(guard),
        release: None,
    })
}

fn unusable(bad: BadInstance) -> Selected {
    match bad {
        BadInstance::Address { name, addr } => Selected::Unusable {
            name: name.clone(),
            failure: Error::InstanceAddress { name, addr },
        },
        BadInstance::NoName => Selected::Retry(Error::NoInstance),
    }
}
