//! The controller's event log: the most recent [`CAPACITY`] events, newest
//! first in snapshots (spec §5.11).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::SystemTime;

use crate::api::{EventSeverity, EventType};
use crate::domain::Function;

/// How many events are kept.
pub const CAPACITY: usize = 200;

/// One recorded event.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub timestamp: SystemTime,
    pub function: Function,
    pub kind: EventType,
    pub message: String,
    pub severity: EventSeverity,
}

/// A bounded, shared event log.
#[derive(Debug, Default)]
pub struct Log {
    // A std mutex: the critical sections push or copy a few entries and never await.
    events: Mutex<VecDeque<Event>>,
}

impl Log {
    /// Appends an event, dropping the oldest beyond [`CAPACITY`].
    pub fn push(
        &self,
        function: &Function,
        kind: EventType,
        severity: EventSeverity,
        message: impl Into<String>,
    ) {
        let event = Event {
            timestamp: SystemTime::now(),
            function: function.clone(),
            kind,
            message: message.into(),
            severity,
        };
        let mut events = self
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        events.push_back(event);
        while events.len() > CAPACITY {
            events.pop_front();
        }
    }

    /// The events, newest first.
    #[must_use]
    pub fn snapshot(&self) -> Vec<Event> {
        let events = self
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        events.iter().rev().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_two_hundred_newest_first() {
        let log = Log::default();
        let f = Function::default();
        for i in 0..250 {
            log.push(
                &f,
                EventType::PodAssigned,
                EventSeverity::Info,
                format!("assigned pod p{i}"),
            );
        }
        let snap = log.snapshot();
        assert_eq!(snap.len(), CAPACITY);
        assert_eq!(snap[0].message, "assigned pod p249");
        assert_eq!(snap[199].message, "assigned pod p50");
    }
}
