//! What several modules of the router's suite share beyond the harness of
//! `skipper_test_support::router`.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use futures::{SinkExt as _, StreamExt as _};
use skipper::domain::HEADER_FUNCTION;
use skipper_test_support::router::app_header;
use tokio_tungstenite::tungstenite::{Message, client::IntoClientRequest as _};

const LIMIT: Duration = Duration::from_secs(10);

/// A WebSocket client connection.
pub type WebSocket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A WebSocket through the router at `router` to the test upstream's `/ws`
/// echo, for [`app_header`]'s function: upgraded with `101` and already
/// echoing a text message back.
pub async fn echoing_websocket(router: SocketAddr) -> WebSocket {
    let mut req = format!("ws://{router}/ws").into_client_request().unwrap();
    req.headers_mut()
        .insert(HEADER_FUNCTION, app_header().parse().unwrap());
    let (mut ws, resp) = tokio::time::timeout(LIMIT, tokio_tungstenite::connect_async(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 101);
    ws.send(Message::text("ping")).await.unwrap();
    let reply = tokio::time::timeout(LIMIT, ws.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(reply.into_text().unwrap().as_str(), "ping");
    ws
}
