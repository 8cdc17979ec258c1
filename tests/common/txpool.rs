//! A loopback **transaction-pooling proxy** with a single server connection,
//! speaking the PostgreSQL wire protocol (v3), for tests.
//!
//! # Why it exists
//!
//! PgBouncer 1.21 and later, with `pool_mode=transaction` and
//! `max_prepared_statements` set, renames the prepared statements of its
//! clients, so two clients that both prepare `sqlx_s_1` never collide on a
//! shared server session. When its pool has *one* server connection, every
//! statement of every client then reaches the same backend: the backend pid
//! never changes and no prepared-statement error (42P05, 26000) ever
//! reaches a client, so neither of the signals distlock uses to detect a
//! transaction pooler appears. Session-level advisory locks are re-entrant,
//! so a second client's `pg_try_advisory_lock` on a key the first client
//! holds returns `true` on that shared backend. The PgBouncer packaged by
//! Debian (1.18) has no `max_prepared_statements`, hence this proxy.
//!
//! # What it does
//!
//! - Listens on `127.0.0.1:0` and opens exactly one connection to the
//!   upstream server (trust authentication only), started with the
//!   parameters sqlx itself sends (`DateStyle`, `client_encoding`,
//!   `TimeZone`, `extra_float_digits`) plus an `application_name` of its own.
//! - Greets each client by itself: `SSLRequest` and `GSSENCRequest` are
//!   answered `N`, a `CancelRequest` is refused (the connection is closed),
//!   the client's startup parameters are ignored, and the client gets
//!   `AuthenticationOk`, the server's `ParameterStatus` messages, a made-up
//!   `BackendKeyData` and `ReadyForQuery`.
//! - Pools transactions: a client takes the server connection when it sends
//!   the first message of a transaction and keeps it until the server
//!   answers the client's last `Sync` or `Query` with `ReadyForQuery` in
//!   state idle (`I`) and no extended-protocol message of the client awaits
//!   a `Sync`. A client inside a transaction block (`T`, or `E` after an
//!   error) keeps it until it commits or rolls back. The others wait in
//!   line (a mutex around the server connection).
//! - Hides prepared statements: statement names in `Parse`, `Bind`,
//!   `Describe` and `Close` are prefixed with a per-client tag (`c7_`), the
//!   unnamed statement stays unnamed, portal names are left alone. When a
//!   client leaves, its statements are closed on the server.
//! - A client's `Terminate` ends that client only. A client that goes away
//!   inside a transaction (or with messages awaiting a `Sync`) is cleaned up
//!   on its behalf: `Sync`, the answers drained, then `ROLLBACK` if a
//!   transaction block is still open. Session state (advisory locks, `SET`
//!   without `LOCAL`) stays on the server session, as it does with PgBouncer.
//!
//! # Limits
//!
//! One server connection, so a statement that waits (for a lock held by a
//! session outside the proxy, say) holds up every client. No TLS, no
//! authentication other than trust, no cancel requests, no `COPY` beyond
//! what plain forwarding gives, no replication protocol. A client that
//! pipelines a lot of input while the server produces a lot of output can
//! deadlock the forwarding (it writes whole messages without reading in
//! between). A server connection that fails is not replaced: every client
//! is disconnected from then on (a test can replace it on purpose:
//! [`TxPool::replace_server`]). Client `SET`s change the shared session for
//! everyone, and `ParameterStatus` changes reach whichever client owns the
//! server connection at that moment.

use std::collections::HashSet;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::task::AbortHandle;

/// Protocol version 3.0 in a StartupMessage.
const PROTOCOL_3: i32 = 196_608;
/// The codes that take the place of a protocol version in special requests.
const SSL_REQUEST: i32 = 80_877_103;
const GSSENC_REQUEST: i32 = 80_877_104;
const CANCEL_REQUEST: i32 = 80_877_102;

/// Largest message accepted in either direction.
const MAX_MESSAGE: usize = 64 << 20;

/// The startup parameters sqlx's `PgConnection::establish` sends (with its
/// default `extra_float_digits`), so clients see the session they expect.
const STARTUP_PARAMS: &[(&str, &str)] = &[
    ("DateStyle", "ISO, MDY"),
    ("client_encoding", "UTF8"),
    ("TimeZone", "UTC"),
    ("extra_float_digits", "2"),
    ("application_name", "distlock-txpool"),
];

/// Clients get made-up backend pids above any real `pid_max` (2^22).
const FAKE_PID_BASE: u32 = 0x4000_0000;

/// A running proxy; stops (closing every client and the server connection)
/// when dropped.
#[derive(Debug)]
pub struct TxPool {
    addr: SocketAddr,
    shared: Arc<Shared>,
    tasks: Arc<StdMutex<Vec<AbortHandle>>>,
    listener: AbortHandle,
}

#[derive(Debug)]
struct Shared {
    server: Mutex<Server>,
    /// The server's `ParameterStatus` messages from its startup, encoded.
    parameters: Vec<u8>,
    backend_pid: AtomicI32,
    clients: AtomicUsize,
    /// Host, port, user and database of the server, for
    /// [`TxPool::replace_server`].
    upstream: (String, u16, String, String),
}

#[derive(Debug)]
struct Server {
    reader: MsgReader,
    writer: OwnedWriteHalf,
    /// Set once the server connection failed or lost track of the
    /// protocol; clients are disconnected from then on.
    broken: bool,
}

impl TxPool {
    /// Connects to `upstream_host:upstream_port` as `user` (trust
    /// authentication) to `database`, then listens on `127.0.0.1:0`.
    pub async fn start(
        upstream_host: &str,
        upstream_port: u16,
        user: &str,
        database: &str,
    ) -> io::Result<Self> {
        let (server, parameters, backend_pid) =
            connect_server(upstream_host, upstream_port, user, database).await?;
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            server: Mutex::new(server),
            parameters,
            backend_pid: AtomicI32::new(backend_pid),
            clients: AtomicUsize::new(0),
            upstream: (
                upstream_host.to_owned(),
                upstream_port,
                user.to_owned(),
                database.to_owned(),
            ),
        });
        let tasks: Arc<StdMutex<Vec<AbortHandle>>> = Arc::default();
        let accept = {
            let shared = shared.clone();
            let tasks = tasks.clone();
            let next_id = AtomicU32::new(1);
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    let id = next_id.fetch_add(1, Ordering::Relaxed);
                    let handle = tokio::spawn(serve_client(client, shared.clone(), id));
                    let mut tasks = tasks.lock().expect("txpool mutex");
                    tasks.retain(|h| !h.is_finished());
                    tasks.push(handle.abort_handle());
                }
            })
        };
        Ok(Self {
            addr,
            shared,
            tasks,
            listener: accept.abort_handle(),
        })
    }

    /// The port clients should connect to (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// How many clients completed their startup so far.
    pub fn clients(&self) -> usize {
        self.shared.clients.load(Ordering::SeqCst)
    }

    /// The pid of the one server backend (from its `BackendKeyData`).
    pub fn backend_pid(&self) -> i32 {
        self.shared.backend_pid.load(Ordering::SeqCst)
    }

    /// Opens a new server connection and sends every later transaction of
    /// every client there, as a pooler that gave a client another server
    /// connection would; the old one is closed once no transaction runs on
    /// it, so its backend ends and frees what it held. Returns the new
    /// backend's pid.
    pub async fn replace_server(&self) -> io::Result<i32> {
        let (host, port, user, database) = &self.shared.upstream;
        let (server, _, pid) = connect_server(host, *port, user, database).await?;
        let old = std::mem::replace(&mut *self.shared.server.lock().await, server);
        self.shared.backend_pid.store(pid, Ordering::SeqCst);
        drop(old);
        Ok(pid)
    }
}

impl Drop for TxPool {
    fn drop(&mut self) {
        self.listener.abort();
        for handle in self.tasks.lock().expect("txpool mutex").drain(..) {
            handle.abort();
        }
    }
}

/// One protocol message: type byte and body (without the length).
#[derive(Debug)]
struct Msg {
    tag: u8,
    body: Vec<u8>,
}

impl Msg {
    fn new(tag: u8, body: Vec<u8>) -> Self {
        Self { tag, body }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.body.len() + 5);
        out.push(self.tag);
        out.extend_from_slice(&len_prefix(self.body.len()));
        out.extend_from_slice(&self.body);
        out
    }
}

/// The 4-byte length field for a body of `body_len` bytes (it counts itself).
fn len_prefix(body_len: usize) -> [u8; 4] {
    i32::try_from(body_len + 4)
        .expect("message size fits the protocol")
        .to_be_bytes()
}

fn be_i32(bytes: &[u8]) -> io::Result<i32> {
    let head: [u8; 4] = bytes
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| invalid("message too short"))?;
    Ok(i32::from_be_bytes(head))
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("txpool: {what}"))
}

/// Reads whole messages from one side. [`next`](Self::next) is cancel safe
/// (bytes read are kept in the buffer), so it can race in `select!`.
#[derive(Debug)]
struct MsgReader {
    half: OwnedReadHalf,
    buf: Vec<u8>,
}

impl MsgReader {
    fn new(half: OwnedReadHalf) -> Self {
        Self {
            half,
            buf: Vec::with_capacity(8192),
        }
    }

    /// The next typed message; `None` at a clean end of stream.
    async fn next(&mut self) -> io::Result<Option<Msg>> {
        loop {
            if self.buf.len() >= 5 {
                let total = 1 + self.message_len(1)?;
                if self.buf.len() >= total {
                    let tag = self.buf[0];
                    let body = self.buf[5..total].to_vec();
                    self.buf.drain(..total);
                    return Ok(Some(Msg::new(tag, body)));
                }
            }
            if !self.fill().await? {
                return Ok(None);
            }
        }
    }

    /// The next untyped message (startup phase): its body after the length.
    async fn next_untyped(&mut self) -> io::Result<Option<Vec<u8>>> {
        loop {
            if self.buf.len() >= 4 {
                let total = self.message_len(0)?;
                if self.buf.len() >= total {
                    let body = self.buf[4..total].to_vec();
                    self.buf.drain(..total);
                    return Ok(Some(body));
                }
            }
            if !self.fill().await? {
                return Ok(None);
            }
        }
    }

    /// The length field at `at`, checked.
    fn message_len(&self, at: usize) -> io::Result<usize> {
        let len = usize::try_from(be_i32(&self.buf[at..])?)
            .map_err(|_| invalid("negative message length"))?;
        if !(4..=MAX_MESSAGE).contains(&len) {
            return Err(invalid("bad message length"));
        }
        Ok(len)
    }

    /// Reads more bytes; `false` at a clean end of stream.
    async fn fill(&mut self) -> io::Result<bool> {
        self.buf.reserve(8192);
        if self.half.read_buf(&mut self.buf).await? > 0 {
            return Ok(true);
        }
        if self.buf.is_empty() {
            Ok(false)
        } else {
            Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "txpool: stream ended inside a message",
            ))
        }
    }
}

/// Opens the one server connection; returns it with the encoded
/// `ParameterStatus` messages and the backend pid.
async fn connect_server(
    host: &str,
    port: u16,
    user: &str,
    database: &str,
) -> io::Result<(Server, Vec<u8>, i32)> {
    let stream = TcpStream::connect((host, port)).await?;
    stream.set_nodelay(true)?;
    let (read, mut writer) = stream.into_split();
    let mut reader = MsgReader::new(read);

    let mut body = PROTOCOL_3.to_be_bytes().to_vec();
    let params = [("user", user), ("database", database)];
    for (name, value) in params.iter().chain(STARTUP_PARAMS) {
        body.extend_from_slice(name.as_bytes());
        body.push(0);
        body.extend_from_slice(value.as_bytes());
        body.push(0);
    }
    body.push(0);
    let mut startup = len_prefix(body.len()).to_vec();
    startup.extend_from_slice(&body);
    writer.write_all(&startup).await?;

    let mut parameters = Vec::new();
    let mut backend_pid = 0;
    loop {
        let msg = reader
            .next()
            .await?
            .ok_or_else(|| invalid("upstream closed the connection during startup"))?;
        match msg.tag {
            b'R' => match be_i32(&msg.body)? {
                0 => {}
                method => {
                    return Err(io::Error::other(format!(
                        "txpool: upstream asked for authentication method {method}; \
                         only trust authentication (AuthenticationOk) is supported"
                    )));
                }
            },
            b'S' => parameters.extend_from_slice(&msg.encode()),
            b'K' => backend_pid = be_i32(&msg.body)?,
            b'N' => {}
            b'E' => {
                return Err(io::Error::other(format!(
                    "txpool: upstream refused the connection: {}",
                    error_text(&msg.body)
                )));
            }
            b'Z' => break,
            other => {
                return Err(invalid(&format!(
                    "unexpected message {:?} during startup",
                    char::from(other)
                )));
            }
        }
    }
    let server = Server {
        reader,
        writer,
        broken: false,
    };
    Ok((server, parameters, backend_pid))
}

/// SQLSTATE and message of an `ErrorResponse` body.
fn error_text(body: &[u8]) -> String {
    let mut code = String::new();
    let mut message = String::new();
    for field in body.split(|b| *b == 0) {
        match field.split_first() {
            Some((b'C', rest)) => code = String::from_utf8_lossy(rest).into_owned(),
            Some((b'M', rest)) => message = String::from_utf8_lossy(rest).into_owned(),
            _ => {}
        }
    }
    format!("{message} (SQLSTATE {code})")
}

/// One client connection after its startup.
struct Client {
    reader: MsgReader,
    writer: OwnedWriteHalf,
    /// Prefix of this client's statement names on the server.
    tag: Vec<u8>,
    /// Server-side names of the statements this client prepared.
    prepared: HashSet<Vec<u8>>,
}

impl Client {
    /// Renames the statement a `Parse`, `Bind`, `Describe` or `Close` refers
    /// to; the unnamed statement and portals are left alone.
    fn rewrite(&mut self, msg: &mut Msg) -> io::Result<()> {
        match msg.tag {
            b'P' => {
                if let Some(name) = prefix_name(&mut msg.body, 0, &self.tag)? {
                    self.prepared.insert(name);
                }
            }
            b'B' => {
                let portal_end = cstring_end(&msg.body, 0)?;
                prefix_name(&mut msg.body, portal_end + 1, &self.tag)?;
            }
            b'D' if msg.body.first() == Some(&b'S') => {
                prefix_name(&mut msg.body, 1, &self.tag)?;
            }
            b'C' if msg.body.first() == Some(&b'S') => {
                if let Some(name) = prefix_name(&mut msg.body, 1, &self.tag)? {
                    self.prepared.remove(&name);
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// Index of the NUL ending the string that starts at `at`.
fn cstring_end(body: &[u8], at: usize) -> io::Result<usize> {
    body.get(at..)
        .and_then(|rest| rest.iter().position(|b| *b == 0))
        .map(|n| at + n)
        .ok_or_else(|| invalid("unterminated string"))
}

/// Prefixes the (non-empty) name at `at` with `tag`; returns the new name.
fn prefix_name(body: &mut Vec<u8>, at: usize, tag: &[u8]) -> io::Result<Option<Vec<u8>>> {
    let end = cstring_end(body, at)?;
    if end == at {
        return Ok(None);
    }
    body.splice(at..at, tag.iter().copied());
    Ok(Some(body[at..end + tag.len()].to_vec()))
}

/// Where a client's exchange with the server stands while it owns it.
#[derive(Debug)]
struct Exchange {
    /// `Sync`s and `Query`s forwarded whose `ReadyForQuery` has not come back.
    pending: usize,
    /// Extended-protocol messages forwarded since the last `Sync`.
    unsynced: bool,
    /// Transaction status of the last `ReadyForQuery`.
    status: u8,
}

impl Exchange {
    /// The server connection is idle when handed to a client.
    fn new() -> Self {
        Self {
            pending: 0,
            unsynced: false,
            status: b'I',
        }
    }

    fn sent(&mut self, tag: u8) {
        match tag {
            b'S' => {
                self.pending += 1;
                self.unsynced = false;
            }
            b'Q' => self.pending += 1,
            // Flush asks for output, it does not open anything.
            b'H' => {}
            // Parse, Bind, Describe, Execute, Close (and COPY data) wait
            // for a Sync.
            _ => self.unsynced = true,
        }
    }

    fn ready(&mut self, status: Option<&u8>) {
        self.pending = self.pending.saturating_sub(1);
        self.status = status.copied().unwrap_or(b'I');
    }

    /// At a transaction boundary: everything answered, nothing open.
    fn at_boundary(&self) -> bool {
        self.pending == 0 && !self.unsynced && self.status == b'I'
    }
}

/// How a client's turn with the server connection ended.
enum Turn {
    /// At a transaction boundary; the server connection is free again.
    Released,
    /// The client went away (or sent `Terminate`, or garbage).
    ClientGone,
    /// The server connection failed.
    ServerFailed,
}

async fn serve_client(stream: TcpStream, shared: Arc<Shared>, id: u32) {
    let _ = stream.set_nodelay(true);
    let (read, writer) = stream.into_split();
    let mut client = Client {
        reader: MsgReader::new(read),
        writer,
        tag: format!("c{id}_").into_bytes(),
        prepared: HashSet::new(),
    };
    if !matches!(
        handshake(&mut client.reader, &mut client.writer).await,
        Ok(true)
    ) {
        return;
    }
    shared.clients.fetch_add(1, Ordering::SeqCst);
    if client
        .writer
        .write_all(&welcome(&shared, id))
        .await
        .is_err()
    {
        return;
    }
    loop {
        let first = match client.reader.next().await {
            Ok(Some(msg)) if msg.tag != b'X' => msg,
            _ => break,
        };
        let mut server = shared.server.lock().await;
        if server.broken {
            return;
        }
        let mut exchange = Exchange::new();
        match turn(&mut server, &mut client, first, &mut exchange).await {
            Turn::Released => {}
            Turn::ClientGone => {
                if abandon(&mut server, &mut exchange).await.is_err() {
                    server.broken = true;
                    return;
                }
                break;
            }
            Turn::ServerFailed => {
                server.broken = true;
                return;
            }
        }
    }
    let mut server = shared.server.lock().await;
    if !server.broken && forget(&mut server, &client.prepared).await.is_err() {
        server.broken = true;
    }
}

/// Startup of a client: `Ok(true)` once it sent a v3 StartupMessage.
async fn handshake(reader: &mut MsgReader, writer: &mut OwnedWriteHalf) -> io::Result<bool> {
    loop {
        let Some(body) = reader.next_untyped().await? else {
            return Ok(false);
        };
        match be_i32(&body)? {
            SSL_REQUEST | GSSENC_REQUEST => writer.write_all(b"N").await?,
            PROTOCOL_3 => return Ok(true),
            CANCEL_REQUEST => return Ok(false),
            _ => {
                let mut error = Vec::new();
                for (field, value) in [
                    (b'S', "FATAL"),
                    (b'C', "08P01"),
                    (b'M', "txpool: unsupported protocol version"),
                ] {
                    error.push(field);
                    error.extend_from_slice(value.as_bytes());
                    error.push(0);
                }
                error.push(0);
                writer.write_all(&Msg::new(b'E', error).encode()).await?;
                return Ok(false);
            }
        }
    }
}

/// AuthenticationOk, the server's parameters, made-up key data, ReadyForQuery.
fn welcome(shared: &Shared, id: u32) -> Vec<u8> {
    let mut out = Msg::new(b'R', 0i32.to_be_bytes().to_vec()).encode();
    out.extend_from_slice(&shared.parameters);
    let mut key = (FAKE_PID_BASE + id).to_be_bytes().to_vec();
    key.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&Msg::new(b'K', key).encode());
    out.extend_from_slice(&Msg::new(b'Z', vec![b'I']).encode());
    out
}

/// One client's turn with the server connection: forwards both ways until
/// a transaction boundary, the client leaving, or a server failure.
async fn turn(
    server: &mut Server,
    client: &mut Client,
    first: Msg,
    exchange: &mut Exchange,
) -> Turn {
    let mut next = Some(first);
    loop {
        if let Some(mut msg) = next.take() {
            if msg.tag == b'X' || client.rewrite(&mut msg).is_err() {
                return Turn::ClientGone;
            }
            exchange.sent(msg.tag);
            if server.writer.write_all(&msg.encode()).await.is_err() {
                return Turn::ServerFailed;
            }
        }
        tokio::select! {
            from_client = client.reader.next() => match from_client {
                Ok(Some(msg)) => next = Some(msg),
                _ => return Turn::ClientGone,
            },
            from_server = server.reader.next() => {
                let Ok(Some(msg)) = from_server else {
                    return Turn::ServerFailed;
                };
                if msg.tag == b'Z' {
                    exchange.ready(msg.body.first());
                }
                if client.writer.write_all(&msg.encode()).await.is_err() {
                    return Turn::ClientGone;
                }
                if msg.tag == b'Z' && exchange.at_boundary() {
                    return Turn::Released;
                }
            }
        }
    }
}

/// Brings the server connection back to a boundary for a client that left
/// in the middle of its turn: `Sync` if needed, drain, `ROLLBACK` if a
/// transaction block is still open.
async fn abandon(server: &mut Server, exchange: &mut Exchange) -> io::Result<()> {
    if exchange.unsynced {
        server.send(&Msg::new(b'S', Vec::new())).await?;
        exchange.sent(b'S');
    }
    server.drain(exchange).await?;
    if exchange.status != b'I' {
        server.send(&query("ROLLBACK")).await?;
        exchange.sent(b'Q');
        server.drain(exchange).await?;
    }
    if exchange.status == b'I' {
        Ok(())
    } else {
        Err(invalid("server connection not idle after ROLLBACK"))
    }
}

/// Closes a departed client's prepared statements on the server.
async fn forget(server: &mut Server, prepared: &HashSet<Vec<u8>>) -> io::Result<()> {
    if prepared.is_empty() {
        return Ok(());
    }
    let mut exchange = Exchange::new();
    for name in prepared {
        let mut body = vec![b'S'];
        body.extend_from_slice(name);
        body.push(0);
        server.send(&Msg::new(b'C', body)).await?;
        exchange.sent(b'C');
    }
    server.send(&Msg::new(b'S', Vec::new())).await?;
    exchange.sent(b'S');
    server.drain(&mut exchange).await
}

/// A simple-protocol `Query` message.
fn query(sql: &str) -> Msg {
    let mut body = sql.as_bytes().to_vec();
    body.push(0);
    Msg::new(b'Q', body)
}

impl Server {
    async fn send(&mut self, msg: &Msg) -> io::Result<()> {
        self.writer.write_all(&msg.encode()).await
    }

    /// Discards server messages until every pending `ReadyForQuery` came.
    async fn drain(&mut self, exchange: &mut Exchange) -> io::Result<()> {
        while exchange.pending > 0 {
            let msg = self
                .reader
                .next()
                .await?
                .ok_or_else(|| invalid("server closed the connection"))?;
            if msg.tag == b'Z' {
                exchange.ready(msg.body.first());
            }
        }
        Ok(())
    }
}
