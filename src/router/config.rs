//! Flags of `skipper router` and the validated [`Config`] built from them.
//!
//! Every check runs at start-up and names the flag it is about.

use std::net::SocketAddr;
use std::time::Duration;

use super::proxy::TrustedProxies;
use crate::config::parse_duration;

/// Flags of `skipper router`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// HTTP bind host
    #[arg(long, env = "SKIPPER_HOST", default_value = "0.0.0.0")]
    pub host: String,

    /// HTTP port
    #[arg(long, env = "SKIPPER_PORT", default_value_t = 8080)]
    pub port: u16,

    /// Maximum time to drain in-flight requests on shutdown
    #[arg(long, env = "SKIPPER_SHUTDOWN_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,

    /// After SIGTERM, keep serving this long (unready, every response with Connection: close) before closing idle connections and draining
    #[arg(long, env = "SKIPPER_SHUTDOWN_DELAY", default_value = "0s", value_parser = parse_duration)]
    pub shutdown_delay: Duration,

    /// This router's IP, sent as router_ip in heartbeats (controllers key heartbeat state by it)
    #[arg(long, env = "SKIPPER_POD_IP")]
    pub pod_ip: String,

    /// Period of the batched heartbeat sent to the controllers
    #[arg(long, env = "SKIPPER_HEARTBEAT_INTERVAL", default_value = "5s", value_parser = parse_duration)]
    pub heartbeat_interval: Duration,

    /// Attempts in total per request (getting an instance and connecting to it)
    #[arg(long, env = "SKIPPER_MAX_ROUND_TRIP_ATTEMPTS", default_value_t = 6)]
    pub max_round_trip_attempts: u32,

    /// Smallest backoff between round-trip attempts
    #[arg(long, env = "SKIPPER_ROUND_TRIP_RETRY_MIN_TIMEOUT", default_value = "100ms", value_parser = parse_duration)]
    pub round_trip_retry_min_timeout: Duration,

    /// Largest backoff between round-trip attempts
    #[arg(long, env = "SKIPPER_ROUND_TRIP_RETRY_MAX_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub round_trip_retry_max_timeout: Duration,

    /// Bound on connecting to an instance (a connect failure is retried on another instance)
    #[arg(long, env = "SKIPPER_DIAL_TIMEOUT", default_value = "2s", value_parser = parse_duration)]
    pub dial_timeout: Duration,

    /// Bound on waiting for an instance's response headers once the request is sent (0s = none)
    #[arg(long, env = "SKIPPER_RESPONSE_HEADER_TIMEOUT", default_value = "0s", value_parser = parse_duration)]
    pub response_header_timeout: Duration,

    /// Bound on a request from arrival to the instance's response headers: 408 while the client is still sending its body, else 504 (0s = none)
    #[arg(long, env = "SKIPPER_REQUEST_TIMEOUT", default_value = "5m", value_parser = parse_duration)]
    pub request_timeout: Duration,

    /// How far a client's request body may fall behind --body-min-rate, and so its longest pause, before the request fails with 408 (0s = none)
    #[arg(long, env = "SKIPPER_BODY_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub body_timeout: Duration,

    /// Average rate in bytes/s a client's request body must keep up, within --body-timeout (0 = only pauses are bounded)
    #[arg(long, env = "SKIPPER_BODY_MIN_RATE", default_value_t = 256)]
    pub body_min_rate: u32,

    /// Longest a response write may wait for a client that reads nothing before the connection is closed (0s = none)
    #[arg(long, env = "SKIPPER_WRITE_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub write_timeout: Duration,

    /// Peers (addresses or networks, comma-separated) whose X-Forwarded-For/-Host/-Proto are kept and extended; anyone else's are replaced
    #[arg(long, env = "SKIPPER_TRUSTED_PROXIES", default_value = "")]
    pub trusted_proxies: String,

    /// Longest a client connection waits for the next request's headers, idle keep-alive included
    #[arg(long, env = "SKIPPER_IDLE_TIMEOUT", default_value = "1m", value_parser = parse_duration)]
    pub idle_timeout: Duration,

    /// Deadline of one GetInstance call to a controller (it may wait for a pool pod)
    #[arg(long, env = "SKIPPER_GET_INSTANCE_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub get_instance_timeout: Duration,

    /// Requests that may wait for an instance at once, router-wide (cold starts, retries through the controller, queues under a function's max_in_flight_requests); more are answered 503, shared fairly between functions
    #[arg(long, env = "SKIPPER_MAX_WAITING_REQUESTS", default_value_t = 1024)]
    pub max_waiting_requests: usize,

    /// Requests of one function that may wait for an instance at once; more are answered 503
    #[arg(
        long,
        env = "SKIPPER_MAX_WAITING_REQUESTS_PER_FUNCTION",
        default_value_t = 256
    )]
    pub max_waiting_requests_per_function: usize,

    /// Controller service DNS name (used when --controller-headless-service-host is empty)
    #[arg(long, env = "SKIPPER_CONTROLLER_SERVICE_HOST")]
    pub controller_service_host: String,

    /// Controller gRPC port
    #[arg(long, env = "SKIPPER_CONTROLLER_PORT", default_value_t = 50051)]
    pub controller_port: u16,

    /// Preferred DNS name of the controllers, resolved to every controller pod
    #[arg(long, env = "SKIPPER_CONTROLLER_HEADLESS_SERVICE_HOST", default_value = "")]
    pub controller_headless_service_host: String,

    /// With --controller-headless-service-name: watch that Service's EndpointSlices in this namespace (zone-aware discovery)
    #[arg(long, env = "SKIPPER_CONTROLLER_NAMESPACE", default_value = "")]
    pub controller_namespace: String,

    /// Name of the headless controller Service whose EndpointSlices are watched
    #[arg(long, env = "SKIPPER_CONTROLLER_HEADLESS_SERVICE_NAME", default_value = "")]
    pub controller_headless_service_name: String,

    /// Token presented to controllers (a projected ServiceAccount token with audience skipper-controller, re-read as it is refreshed); empty: none
    #[arg(long, env = "SKIPPER_CONTROLLER_TOKEN_FILE", default_value = crate::credentials::DEFAULT_TOKEN_FILE)]
    pub controller_token_file: String,

    /// This router's zone; same-zone controller endpoints are preferred
    #[arg(long, env = "SKIPPER_ZONE", default_value = "")]
    pub zone: String,

    #[command(flatten)]
    pub telemetry: crate::telemetry::Args,
}

/// A flag value the router cannot run with. The message names the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidFlag(String);

/// How the router finds controllers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Discovery {
    /// Resolve `host` to all its addresses, re-resolving periodically and on
    /// failure.
    Dns { host: String, port: u16 },
    /// Watch the EndpointSlices of a headless Service, preferring `zone`.
    EndpointSlices {
        namespace: String,
        service: String,
        port: u16,
        zone: String,
    },
    /// Fixed addresses (tests, benchmarks).
    Static(Vec<SocketAddr>),
}

/// Validated router configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub pod_ip: String,
    pub shutdown_timeout: Duration,
    /// How long the router keeps serving after shutdown begins, answering
    /// every request with `Connection: close`, before it stops accepting.
    pub shutdown_delay: Duration,
    pub heartbeat_interval: Duration,
    pub max_round_trip_attempts: u32,
    pub retry_min: Duration,
    pub retry_max: Duration,
    pub dial_timeout: Duration,
    /// `None` = no bound.
    pub response_header_timeout: Option<Duration>,
    /// `None` = no bound.
    pub request_timeout: Option<Duration>,
    /// `None` = no bound.
    pub body_timeout: Option<Duration>,
    /// `None` = pauses alone are bounded.
    pub body_min_rate: Option<std::num::NonZeroU32>,
    /// `None` = no bound.
    pub write_timeout: Option<Duration>,
    /// Peers whose forwarding headers are kept.
    pub trusted_proxies: TrustedProxies,
    pub idle_timeout: Duration,
    pub get_instance_timeout: Duration,
    /// Bounds on requests waiting for instances.
    pub waiting: crate::router::proxy::admission::Limits,
    pub discovery: Discovery,
    /// The token presented to controllers; `None`: calls carry no token.
    pub controller_token_file: Option<std::path::PathBuf>,
    /// Where `/metrics` is served, when telemetry is on.
    pub metrics_addr: Option<SocketAddr>,
}

impl Config {
    /// A configuration with the flag defaults, talking to fixed controller
    /// addresses.
    #[must_use]
    pub fn with_controllers(pod_ip: &str, controllers: Vec<SocketAddr>) -> Self {
        Self {
            pod_ip: pod_ip.to_owned(),
            shutdown_timeout: Duration::from_secs(5),
            shutdown_delay: Duration::ZERO,
            heartbeat_interval: Duration::from_secs(5),
            max_round_trip_attempts: 6,
            retry_min: Duration::from_millis(100),
            retry_max: Duration::from_secs(5),
            dial_timeout: Duration::from_secs(2),
            response_header_timeout: None,
            request_timeout: Some(Duration::from_secs(300)),
            body_timeout: Some(Duration::from_secs(30)),
            body_min_rate: std::num::NonZeroU32::new(256),
            write_timeout: Some(Duration::from_secs(30)),
            trusted_proxies: TrustedProxies::none(),
            idle_timeout: Duration::from_secs(60),
            get_instance_timeout: Duration::from_secs(30),
            waiting: crate::router::proxy::admission::Limits {
                total: 1024,
                per_function: 256,
            },
            discovery: Discovery::Static(controllers),
            controller_token_file: None,
            metrics_addr: None,
        }
    }

    /// Checks the values that flag parsing cannot.
    ///
    /// # Errors
    /// [`InvalidFlag`] naming the first offending flag.
    pub fn validate(&self) -> Result<(), InvalidFlag> {
        let bad = |m: String| Err(InvalidFlag(m));
        if self.pod_ip.is_empty() {
            return bad("--pod-ip must not be empty".into());
        }
        if self.max_round_trip_attempts < 1 {
            return bad("--max-round-trip-attempts must be at least 1".into());
        }
        if self.heartbeat_interval.is_zero() {
            return bad("--heartbeat-interval must be greater than zero".into());
        }
        if self.retry_min.is_zero() {
            return bad("--round-trip-retry-min-timeout must be greater than zero".into());
        }
        if self.retry_max < self.retry_min {
            return bad(format!(
                "--round-trip-retry-max-timeout ({:?}) must be at least --round-trip-retry-min-timeout ({:?})",
                self.retry_max, self.retry_min
            ));
        }
        if self.dial_timeout.is_zero() {
            return bad("--dial-timeout must be greater than zero".into());
        }
        if self.idle_timeout.is_zero() {
            return bad("--idle-timeout must be greater than zero".into());
        }
        if self.get_instance_timeout.is_zero() {
            return bad("--get-instance-timeout must be greater than zero".into());
        }
        if self.waiting.total == 0 {
            return bad("--max-waiting-requests must be at least 1".into());
        }
        if self.waiting.per_function == 0 {
            return bad("--max-waiting-requests-per-function must be at least 1".into());
        }
        match &self.discovery {
            Discovery::Dns { host, port } => {
                if host.is_empty() {
                    return bad("--controller-service-host must not be empty".into());
                }
                if *port == 0 {
                    return bad("--controller-port must not be 0".into());
                }
            }
            Discovery::EndpointSlices { port, .. } => {
                if *port == 0 {
                    return bad("--controller-port must not be 0".into());
                }
            }
            Discovery::Static(_) => {}
        }
        Ok(())
    }
}

fn non_zero(d: Duration) -> Option<Duration> {
    (!d.is_zero()).then_some(d)
}

impl TryFrom<&Args> for Config {
    type Error = InvalidFlag;

    fn try_from(a: &Args) -> Result<Self, Self::Error> {
        let ns = a.controller_namespace.trim();
        let svc = a.controller_headless_service_name.trim();
        let discovery = match (ns.is_empty(), svc.is_empty()) {
            (false, false) => Discovery::EndpointSlices {
                namespace: ns.to_owned(),
                service: svc.to_owned(),
                port: a.controller_port,
                zone: a.zone.trim().to_owned(),
            },
            (true, true) => {
                let headless = a.controller_headless_service_host.trim();
                let host = if headless.is_empty() {
                    a.controller_service_host.trim()
                } else {
                    headless
                };
                Discovery::Dns {
                    host: host.to_owned(),
                    port: a.controller_port,
                }
            }
            (true, false) => {
                return Err(InvalidFlag(
                    "--controller-headless-service-name needs --controller-namespace".into(),
                ));
            }
            (false, true) => {
                return Err(InvalidFlag(
                    "--controller-namespace needs --controller-headless-service-name".into(),
                ));
            }
        };
        let metrics_addr = a.telemetry.metrics_addr().map_err(InvalidFlag)?;
        let trusted_proxies = TrustedProxies::parse(&a.trusted_proxies)
            .map_err(|e| InvalidFlag(format!("--trusted-proxies: {e}")))?;
        let c = Self {
            pod_ip: a.pod_ip.trim().to_owned(),
            shutdown_timeout: a.shutdown_timeout,
            shutdown_delay: a.shutdown_delay,
            heartbeat_interval: a.heartbeat_interval,
            max_round_trip_attempts: a.max_round_trip_attempts,
            retry_min: a.round_trip_retry_min_timeout,
            retry_max: a.round_trip_retry_max_timeout,
            dial_timeout: a.dial_timeout,
            response_header_timeout: non_zero(a.response_header_timeout),
            request_timeout: non_zero(a.request_timeout),
            body_timeout: non_zero(a.body_timeout),
            body_min_rate: std::num::NonZeroU32::new(a.body_min_rate),
            write_timeout: non_zero(a.write_timeout),
            trusted_proxies,
            idle_timeout: a.idle_timeout,
            get_instance_timeout: a.get_instance_timeout,
            waiting: crate::router::proxy::admission::Limits {
                total: a.max_waiting_requests,
                per_function: a.max_waiting_requests_per_function,
            },
            discovery,
            controller_token_file: Some(a.controller_token_file.trim())
                .filter(|p| !p.is_empty())
                .map(std::path::PathBuf::from),
            metrics_addr,
        };
        c.validate()?;
        Ok(c)
    }
}

/// The socket address to serve HTTP on.
///
/// # Errors
/// When `--host`/`--port` do not form an address.
pub fn listen_addr(a: &Args) -> Result<SocketAddr, InvalidFlag> {
    let host = a.host.trim();
    let s = if host.contains(':') {
        format!("[{host}]:{}", a.port)
    } else {
        format!("{host}:{}", a.port)
    };
    s.parse()
        .map_err(|e| InvalidFlag(format!("--host {host:?} is not an IP address: {e}")))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(extra: &[&str]) -> Result<Config, String> {
        let mut argv = vec![
            "router",
            "--pod-ip",
            "10.0.0.9",
            "--controller-service-host",
            "ctrl.svc",
        ];
        argv.extend_from_slice(extra);
        let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
        Config::try_from(&cli.args).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_match_the_flag_table() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.max_round_trip_attempts, 6);
        assert_eq!(c.heartbeat_interval, Duration::from_secs(5));
        assert_eq!(c.retry_min, Duration::from_millis(100));
        assert_eq!(c.retry_max, Duration::from_secs(5));
        assert_eq!(c.dial_timeout, Duration::from_secs(2));
        assert_eq!(c.response_header_timeout, None);
        assert_eq!(c.request_timeout, Some(Duration::from_secs(300)));
        assert_eq!(c.body_timeout, Some(Duration::from_secs(30)));
        assert_eq!(c.body_min_rate, std::num::NonZeroU32::new(256));
        assert_eq!(c.write_timeout, Some(Duration::from_secs(30)));
        assert_eq!(c.trusted_proxies, TrustedProxies::none());
        assert_eq!(c.idle_timeout, Duration::from_secs(60));
        assert_eq!(c.waiting.total, 1024);
        assert_eq!(c.waiting.per_function, 256);
        assert_eq!(
            c.discovery,
            Discovery::Dns {
                host: "ctrl.svc".into(),
                port: 50051
            }
        );
    }

    #[test]
    fn trusted_proxies_and_zero_bounds_parse() {
        let c = parse(&[
            "--trusted-proxies",
            "10.0.0.0/8, 192.0.2.1",
            "--body-min-rate",
            "0",
            "--write-timeout",
            "0s",
            "--request-timeout",
            "0s",
        ])
        .unwrap();
        assert!(c.trusted_proxies.contains("10.20.30.40".parse().unwrap()));
        assert!(c.trusted_proxies.contains("192.0.2.1".parse().unwrap()));
        assert!(!c.trusted_proxies.contains("192.0.2.2".parse().unwrap()));
        assert_eq!(c.body_min_rate, None);
        assert_eq!(c.write_timeout, None);
        assert_eq!(c.request_timeout, None);
    }

    #[test]
    fn headless_host_wins_over_service_host() {
        let c = parse(&["--controller-headless-service-host", "ctrl-headless"]).unwrap();
        assert_eq!(
            c.discovery,
            Discovery::Dns {
                host: "ctrl-headless".into(),
                port: 50051
            }
        );
    }

    #[test]
    fn namespace_and_service_name_select_endpoint_slices() {
        let c = parse(&[
            "--controller-namespace",
            "skipper",
            "--controller-headless-service-name",
            "ctrl",
            "--zone",
            "a",
        ])
        .unwrap();
        assert_eq!(
            c.discovery,
            Discovery::EndpointSlices {
                namespace: "skipper".into(),
                service: "ctrl".into(),
                port: 50051,
                zone: "a".into()
            }
        );
    }

    #[test]
    fn bad_values_name_the_flag() {
        for (argv, msg) in [
            (
                &["--max-round-trip-attempts", "0"][..],
                "--max-round-trip-attempts must be at least 1",
            ),
            (&["--heartbeat-interval", "0s"][..], "--heartbeat-interval"),
            (
                &["--round-trip-retry-min-timeout", "0s"][..],
                "--round-trip-retry-min-timeout",
            ),
            (
                &["--round-trip-retry-max-timeout", "10ms"][..],
                "--round-trip-retry-max-timeout",
            ),
            (&["--dial-timeout", "0s"][..], "--dial-timeout"),
            (&["--idle-timeout", "0s"][..], "--idle-timeout"),
            (&["--body-timeout", "soon"][..], "--body-timeout"),
            (&["--write-timeout", "soon"][..], "--write-timeout"),
            (&["--body-min-rate", "fast"][..], "--body-min-rate"),
            (
                &["--trusted-proxies", "10.0.0.0/8,proxy.local"][..],
                "--trusted-proxies: \"proxy.local\" is not an IP address or network",
            ),
            (&["--controller-port", "0"][..], "--controller-port"),
            (
                &["--max-waiting-requests", "0"][..],
                "--max-waiting-requests must be at least 1",
            ),
            (
                &["--max-waiting-requests-per-function", "0"][..],
                "--max-waiting-requests-per-function must be at least 1",
            ),
            (&["--max-waiting-requests", "many"][..], "--max-waiting-requests"),
            (
                &["--controller-namespace", "skipper"][..],
                "--controller-namespace needs --controller-headless-service-name",
            ),
        ] {
            let err = parse(argv).unwrap_err();
            assert!(err.contains(msg), "{argv:?}: {err}");
        }
        let cli = Cli::try_parse_from(["router", "--pod-ip", "", "--controller-service-host", "x"]).unwrap();
        let err = Config::try_from(&cli.args).unwrap_err();
        assert_eq!(err.to_string(), "--pod-ip must not be empty");
    }

    #[test]
    fn required_flags_are_required() {
        let err = Cli::try_parse_from(["router", "--pod-ip", "1.2.3.4"]).unwrap_err();
        assert!(err.to_string().contains("--controller-service-host"), "{err}");
        let err = Cli::try_parse_from(["router", "--controller-service-host", "x"]).unwrap_err();
        assert!(err.to_string().contains("--pod-ip"), "{err}");
    }
}
