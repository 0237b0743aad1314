//! PASETO assignment tokens: signed by the controller, verified by pods.
