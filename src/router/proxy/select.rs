//! Choosing the instance of one attempt: the function's local table while
//! its stream is live, else one `GetInstance` call.

use std::sync::Arc;

use tokio::time::Instant;

use super::{Error, Proxy, Release, Tries};
use crate::api;
use crate::router::activity::InFlightGuard;
use crate::router::entry::Parsed;
use crate::router::instances::{BadInstance, Slot, SlotGuard};

/// The instance of one attempt.
#[derive(Debug)]
pub(super) struct Chosen {
    pub slot: Arc<Slot>,
    /// The request counted on the table's slot for this instance.
    pub guard: Option<SlotGuard>,
    /// A oneshot instance, released when dropped.
    pub release: Option<Release>,
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
    /// The controllers' considered answer: no attempt can change it.
    Final(Error),
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
        if !oneshot {
            let max = parsed.function.scale_or_default().max_instances().max(1) as usize;
            if let Some(guard) = table.choose(max, &tries.excluded) {
                return Selected::Instance(Chosen {
                    slot: guard.slot().clone(),
                    guard: Some(guard),
                    release: None,
                });
            }
        }
        if tries.last.is_some() {
            tries.controller_retries += 1;
            let wait = self
                .settings
                .retry
                .delay(tries.controller_retries, rand::random());
            tokio::time::sleep(wait).await;
        }
        let t0 = Instant::now();
        self.metrics.controller_call("GetInstance");
        let got = self
            .client
            .get_instance_once_timed(
                api::GetInstanceRequest {
                    function: Some(parsed.api.clone()),
                    exclude_instance_names: tries.excluded.clone(),
                },
                self.settings.get_instance_timeout,
            )
            .await;
        let took = t0.elapsed();
        tries.get_instance_time += took;
        self.metrics
            .get_instance_duration
            .get_or_create(&self.metrics.deployment(&parsed.function.deployment))
            .observe(took.as_secs_f64());
        let got = got.map(|(r, timing)| {
            if timing.is_some() {
                tries.timing = timing;
            }
            r
        });
        let instance = match got.map(|r| r.instance) {
            Ok(Some(i)) => i,
            Ok(None) => return Selected::Retry(Error::NoInstance),
            Err(e) => {
                tracing::debug!(error = %e, "failed to get instance for function");
                let every_controller_refuses = crate::client::is_credentials_refusal(e.code())
                    && self.client.endpoints().refusal().is_some();
                return if Error::is_final_get_instance(&e) || every_controller_refuses {
                    // Another controller gives the same answer: no retry helps.
                    Selected::Final(Error::from_get_instance(e))
                } else {
                    Selected::Retry(Error::from_get_instance(e))
                };
            }
        };
        let release = oneshot.then(|| Release {
            client: self.client.clone(),
            instance: Box::new(instance.clone()),
            tracker: self.tracker.clone(),
            metrics: self.metrics.clone(),
        });
        match Slot::new(&instance) {
            Ok(fresh) => {
                // Counted on the table's slot when the table knows it (and
                // it is not draining), so local choices and idle reports see
                // this request too.
                let guard = table.guard_for(&fresh.name);
                let slot = guard
                    .as_ref()
                    .map_or_else(|| Arc::new(fresh), |g| g.slot().clone());
                Selected::Instance(Chosen { slot, guard, release })
            }
            Err(BadInstance::Address { name, addr }) => Selected::Unusable {
                name: name.clone(),
                failure: Error::InstanceAddress { name, addr },
            },
            Err(BadInstance::NoName) => Selected::Retry(Error::NoInstance),
        }
    }
}
