//! A supervisor's mailbox: a bounded queue of commands and a wake-up.
//!
//! Small while idle: an empty queue holds no allocation (a drained queue
//! gives its buffer back), and the wake-up is a [`Notify`]. A full mailbox
//! refuses at once ([`Refused::Full`]): the function already has
//! [`CAPACITY`] scale requests waiting, and one more waiting caller would
//! not be served sooner.

use std::collections::VecDeque;
use std::sync::Mutex;

use tokio::sync::Notify;

use super::Command;
use crate::controller::error::Error;
use crate::domain::Function;

/// Most commands waiting for one supervisor.
pub const CAPACITY: usize = 1024;

/// Why a command was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refused {
    /// The actor has exited.
    Closed,
    /// [`CAPACITY`] commands are waiting.
    Full,
}

impl Refused {
    pub(super) fn into_error(self, f: &Function) -> Error {
        match self {
            Self::Closed => Error::SupervisorStopped,
            Self::Full => Error::MailboxFull {
                namespace: f.namespace.clone(),
                deployment: f.deployment.clone(),
                tenant: f.tenant.clone(),
                capacity: CAPACITY,
            },
        }
    }
}

#[derive(Debug, Default)]
struct Queue {
    commands: VecDeque<Command>,
    closed: bool,
}

/// Commands for one actor.
#[derive(Debug, Default)]
pub(super) struct Mailbox {
    // A std mutex: push and pop only, never across an await.
    queue: Mutex<Queue>,
    wake: Notify,
}

impl Mailbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues `cmd` and wakes the actor.
    pub(super) fn push(&self, cmd: Command) -> Result<(), Refused> {
        {
            let mut q = self.lock();
            if q.closed {
                return Err(Refused::Closed);
            }
            if q.commands.len() >= CAPACITY {
                return Err(Refused::Full);
            }
            q.commands.push_back(cmd);
        }
        self.wake.notify_one();
        Ok(())
    }

    /// The oldest waiting command.
    pub(super) fn pop(&self) -> Option<Command> {
        let mut q = self.lock();
        let cmd = q.commands.pop_front();
        if q.commands.is_empty() && q.commands.capacity() > 0 {
            q.commands = VecDeque::new();
        }
        cmd
    }

    /// Resolves when a command may have arrived (or [`Mailbox::wake`] was
    /// called) since the last call.
    pub(super) async fn woken(&self) {
        self.wake.notified().await;
    }

    /// Wakes the actor without a command (its spec changed).
    pub(super) fn wake(&self) {
        self.wake.notify_one();
    }

    /// Whether a command is waiting.
    pub(super) fn has_commands(&self) -> bool {
        !self.lock().commands.is_empty()
    }

    /// Refuses further commands and returns those still waiting.
    pub(super) fn close(&self) -> VecDeque<Command> {
        let mut q = self.lock();
        q.closed = true;
        std::mem::take(&mut q.commands)
    }

    /// Whether the actor has exited.
    pub(super) fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Number of waiting commands.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.lock().commands.len()
    }
}
