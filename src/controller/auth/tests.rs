//! The authenticator over a scripted reviewer, on paused time.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

/// Answers by token: `router`, `controller`, `stranger`, `person` pass as
/// those identities, `bad` fails, `down` is an error.
#[derive(Default)]
struct Scripted {
    calls: Arc<AtomicUsize>,
}

impl Reviewer for Scripted {
    fn review<'a>(&'a self, token: &'a str, audience: &'a str) -> BoxFuture<'a, Result<Review, String>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        assert_eq!(audience, "skipper-controller");
        claims(token).expect("only well-formed tokens are reviewed");
        let who = token.rsplit('.').next().unwrap_or_default().to_owned();
        Box::pin(async move {
            Ok(match who.as_str() {
                "router" => Review::Passed {
                    user: "system:serviceaccount:skipper:skipper-router".into(),
                    pod: Some("skipper-router-abc".into()),
                },
                "controller" => Review::Passed {
                    user: "system:serviceaccount:skipper:skipper-controller".into(),
                    pod: None,
                },
                "stranger" => Review::Passed {
                    user: "system:serviceaccount:default:default".into(),
                    pod: None,
                },
                "person" => Review::Passed {
                    user: "alice".into(),
                    pod: None,
                },
                "down" => return Err("connection refused".into()),
                _ => Review::Failed("invalid bearer token".into()),
            })
        })
    }
}

fn policy(allow_unauthenticated: bool) -> Policy {
    let sa = |n: &str| ServiceAccount {
        namespace: "skipper".into(),
        name: n.into(),
    };
    Policy {
        allow_unauthenticated,
        audience: "skipper-controller".into(),
        routers: vec![sa("skipper-router")],
        controllers: vec![sa("skipper-controller")],
    }
}

fn authenticator(allow_unauthenticated: bool) -> (Authenticator, Arc<AtomicUsize>) {
    let reviewer = Scripted::default();
    let calls = reviewer.calls.clone();
    let a = Authenticator::new(policy(allow_unauthenticated), reviewer, Metrics::unregistered());
    (a, calls)
}

/// A JWT-shaped token with these claims; its signature names the scripted answer.
fn token(aud: &serde_json::Value, exp_in: i64, who: &str) -> String {
    let b64 = |v: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
    let claims = serde_json::json!({"aud": aud, "exp": unix_now() + exp_in, "sub": "x"});
    format!(
        "{}.{}.{who}",
        b64(br#"{"alg":"ES256"}"#),
        b64(claims.to_string().as_bytes())
    )
}

fn good(who: &str) -> String {
    token(&serde_json::json!(["skipper-controller"]), 3600, who)
}

/// Missing, malformed or refused: `UNAUTHENTICATED` on the wire (the
/// codes are [`crate::controller::error`]'s).
fn unauthenticated(e: &AuthError) -> bool {
    matches!(
        e,
        AuthError::Missing { .. } | AuthError::Malformed(_) | AuthError::Refused(_)
    )
}

fn headers(token: &str) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    h.insert(
        http::header::AUTHORIZATION,
        format!("Bearer {token}").parse().unwrap(),
    );
    h
}

#[tokio::test(start_paused = true)]
async fn a_call_without_a_token_is_unauthenticated_unless_migration_allows_it() {
    let (a, calls) = authenticator(false);
    let err = a.authenticate(&http::HeaderMap::new()).await.unwrap_err();
    assert!(unauthenticated(&err), "{err}");
    assert!(err.to_string().contains("skipper-controller"), "{err}");
    let (open, _) = authenticator(true);
    assert_eq!(
        open.authenticate(&http::HeaderMap::new()).await.unwrap(),
        Caller::Anonymous
    );
    // A token that is presented is still checked.
    let err = open.authenticate(&headers(&good("bad"))).await.unwrap_err();
    assert!(unauthenticated(&err), "{err}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn tokens_that_cannot_pass_are_refused_without_a_review() {
    let (a, calls) = authenticator(false);
    let mut basic = http::HeaderMap::new();
    basic.insert(http::header::AUTHORIZATION, "Basic YTpi".parse().unwrap());
    for h in [
        basic,
        headers("not-a-jwt"),
        headers("a.!!!.c"),
        headers(&token(&serde_json::json!("kubernetes"), 3600, "router")),
        headers(&token(&serde_json::json!(["skipper-controller"]), -10, "router")),
    ] {
        let err = a.authenticate(&h).await.unwrap_err();
        assert!(unauthenticated(&err), "{err}");
    }
    let err = a
        .authenticate(&headers(&token(&serde_json::json!("other"), 3600, "router")))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("audience is not skipper-controller"),
        "{err}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0, "no review for any of them");
}

#[tokio::test(start_paused = true)]
async fn routers_and_controllers_pass_with_their_roles_and_others_are_denied() {
    let (a, _) = authenticator(false);
    assert_eq!(
        a.authenticate(&headers(&good("router"))).await.unwrap(),
        Caller::ServiceAccount {
            namespace: "skipper".into(),
            name: "skipper-router".into(),
            pod: Some("skipper-router-abc".into()),
            role: Role::Router,
        }
    );
    let peer = a.authenticate(&headers(&good("controller"))).await.unwrap();
    assert!(peer.may_forward());
    assert!(
        !a.authenticate(&headers(&good("router")))
            .await
            .unwrap()
            .may_forward(),
        "a router may not forward"
    );
    for who in ["stranger", "person"] {
        let err = a.authenticate(&headers(&good(who))).await.unwrap_err();
        assert!(matches!(err, AuthError::Forbidden { .. }), "{err}");
        assert!(err.to_string().contains("skipper/skipper-router"), "{err}");
    }
    let err = a.authenticate(&headers(&good("bad"))).await.unwrap_err();
    assert!(unauthenticated(&err), "{err}");
    assert!(err.to_string().contains("invalid bearer token"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn reviews_are_cached_a_pass_for_a_minute_a_refusal_for_ten_seconds() {
    let (a, calls) = authenticator(false);
    let (router, bad) = (good("router"), good("bad"));
    for _ in 0..5 {
        a.authenticate(&headers(&router)).await.unwrap();
        a.authenticate(&headers(&bad)).await.unwrap_err();
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2, "one review per token");
    tokio::time::advance(REFUSAL_TTL + Duration::from_secs(1)).await;
    a.authenticate(&headers(&router)).await.unwrap();
    a.authenticate(&headers(&bad)).await.unwrap_err();
    assert_eq!(calls.load(Ordering::SeqCst), 3, "the refusal was asked again");
    tokio::time::advance(PASS_TTL).await;
    a.authenticate(&headers(&router)).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 4, "the pass was asked again");
    // A pass never outlives the token.
    let short = token(&serde_json::json!(["skipper-controller"]), 5, "router");
    a.authenticate(&headers(&short)).await.unwrap();
    tokio::time::advance(Duration::from_secs(6)).await;
    a.authenticate(&headers(&short)).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 6);
}

#[tokio::test(start_paused = true)]
async fn a_failed_review_is_unavailable_and_not_cached() {
    let (a, calls) = authenticator(false);
    let down = good("down");
    for _ in 0..2 {
        let err = a.authenticate(&headers(&down)).await.unwrap_err();
        assert!(matches!(err, AuthError::Unavailable(_)), "{err}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn the_cache_is_bounded() {
    let (a, _) = authenticator(false);
    for i in 0..MAX_CACHED + 100 {
        let t = token(
            &serde_json::json!("skipper-controller"),
            3600 + i64::try_from(i).unwrap(),
            "bad",
        );
        a.authenticate(&headers(&t)).await.unwrap_err();
    }
    assert_eq!(a.cached_len(), MAX_CACHED);
}

#[tokio::test(start_paused = true)]
async fn refusals_are_counted_by_reason() {
    let (a, _) = authenticator(false);
    a.authenticate(&http::HeaderMap::new()).await.unwrap_err();
    a.authenticate(&headers(&good("stranger"))).await.unwrap_err();
    let count = |reason| {
        a.metrics
            .authentication_failures_total
            .get_or_create(&AuthFailureLabels { reason })
            .get()
    };
    assert_eq!(
        (count("missing"), count("forbidden"), count("refused")),
        (1, 1, 0)
    );
}
