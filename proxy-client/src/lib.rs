//! `proxy-client`: the operator's tool on the frontend side. It speaks the
//! frontend protocol of proxy-server in either mode, over the Unix socket or
//! mTLS TCP, like kube-apiserver does, and offers:
//! - `request`: one HTTP(S) request to a node-side address, printed;
//! - `socks5`: a local SOCKS5 server (CONNECT; names resolved on the agent
//!   side, as `socks5h`), optionally with username/password;
//! - `http-proxy`: a local HTTP proxy (CONNECT, and absolute-form requests).
//!
//! Every forwarded connection uses its own tunnel (a fresh frontend
//! connection), as kube-apiserver's single-use tunnels do.

use std::{net::SocketAddr, path::PathBuf, sync::Arc};

use bytes::Bytes;
use clap::{Args as ClapArgs, Parser, Subcommand};
use client::dial::{ClientError, Dialer, Mode, Transport};
use fast_socks5::{
    ReplyError, Socks5Command, server::Socks5ServerProtocol, util::target_addr::TargetAddr,
};
use http_body_util::{BodyExt, Empty, Full, combinators::BoxBody};
use hyper::{Method, Request, Response, StatusCode, body::Incoming};
use hyper_util::rt::TokioIo;
use ops::{error::DisplayErrorStack, tls};
use tokio::{
    io::{AsyncWriteExt, copy_bidirectional},
    net::{TcpListener, TcpStream},
};
use tracing::{debug, info, warn};

/// proxy-client: reach node-side addresses through proxy-server, as kube-apiserver does.
#[derive(Debug, Parser)]
#[command(name = "proxy-client", version, about, args_override_self = true)]
pub struct Args {
    /// How to reach proxy-server.
    #[command(flatten)]
    pub frontend: FrontendArgs,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
    /// Log verbosity as klog's -v (RUST_LOG overrides).
    #[arg(short = 'v', long = "v", default_value_t = 0, global = true)]
    pub verbosity: u8,
}

/// Where proxy-server's frontend is and how to talk to it.
#[derive(Debug, Clone, ClapArgs)]
pub struct FrontendArgs {
    /// Frontend protocol of the server: grpc or http-connect.
    #[arg(long, default_value = "grpc", global = true)]
    pub mode: String,
    /// The server's frontend Unix socket (its --uds-name); else TCP with mTLS.
    #[arg(long, default_value = "", global = true)]
    pub uds_name: String,
    /// TCP frontend host.
    #[arg(long, default_value = "127.0.0.1", global = true)]
    pub server_host: String,
    /// TCP frontend port (the server's --server-port).
    #[arg(long, default_value_t = 8090, global = true)]
    pub server_port: u16,
    /// Name the server certificate must carry (default: --server-host).
    #[arg(long, default_value = "", global = true)]
    pub server_name: String,
    /// CA of the server's frontend certificate (TCP).
    #[arg(long, default_value = "", global = true)]
    pub ca_cert: String,
    /// Client certificate for the TCP frontend (mTLS is mandatory there).
    #[arg(long, default_value = "", global = true)]
    pub client_cert: String,
    /// Key of --client-cert.
    #[arg(long, default_value = "", global = true)]
    pub client_key: String,
}

/// The tool's commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Send one HTTP(S) request through the tunnel and print the answer.
    Request {
        /// The URL, e.g. http://10.0.0.7:10250/healthz.
        url: String,
        /// The method.
        #[arg(long, default_value = "GET")]
        method: String,
        /// CA for an https:// URL's certificate.
        #[arg(long, default_value = "")]
        request_ca_cert: String,
    },
    /// Serve SOCKS5 locally; each connection goes through the tunnel.
    Socks5 {
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1:1080")]
        listen: SocketAddr,
        /// Require this username (with --password).
        #[arg(long)]
        username: Option<String>,
        /// Require this password (with --username); also env PROXY_CLIENT_PASSWORD.
        #[arg(long, env = "PROXY_CLIENT_PASSWORD", hide_env_values = true)]
        password: Option<String>,
    },
    /// Serve an HTTP proxy locally (CONNECT and absolute-form requests).
    HttpProxy {
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1:3128")]
        listen: SocketAddr,
    },
}

/// A bad flag or file (the same error type as the binaries' flags).
pub use ops::flags::FlagError as ArgsError;

impl FrontendArgs {
    /// The dialer these flags describe.
    ///
    /// # Errors
    /// An unknown mode, missing TLS files for TCP, unreadable files.
    pub fn dialer(&self) -> Result<Dialer, ArgsError> {
        let mode = match self.mode.as_str() {
            "grpc" => Mode::Grpc,
            "http-connect" => Mode::HttpConnect,
            other => {
                return Err(ArgsError::Invalid {
                    flag: "mode",
                    reason: format!("{other:?} is not grpc or http-connect"),
                });
            }
        };
        if !self.uds_name.is_empty() {
            return Ok(Dialer {
                transport: Transport::Uds(PathBuf::from(&self.uds_name)),
                mode,
            });
        }
        for (flag, value) in [
            ("ca-cert", &self.ca_cert),
            ("client-cert", &self.client_cert),
            ("client-key", &self.client_key),
        ] {
            if value.is_empty() {
                return Err(ArgsError::Invalid {
                    flag,
                    reason: "required for the TCP frontend (or give --uds-name)".to_owned(),
                });
            }
        }
        let tls = tls::client_config(
            PathBuf::from(&self.ca_cert).as_path(),
            Some((
                PathBuf::from(&self.client_cert).as_path(),
                PathBuf::from(&self.client_key).as_path(),
            )),
            &[],
        )
        .map_err(|source| ArgsError::Tls {
            flag: if source.path() == std::path::Path::new(&self.ca_cert) {
                "ca-cert"
            } else if source.path() == std::path::Path::new(&self.client_key) {
                "client-key"
            } else {
                "client-cert"
            },
            source,
        })?;
        let addr = format!("{}:{}", self.server_host, self.server_port);
        let addr = std::net::ToSocketAddrs::to_socket_addrs(&addr)
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| ArgsError::Invalid {
                flag: "server-host",
                reason: format!("cannot resolve {addr}"),
            })?;
        let server_name = if self.server_name.is_empty() {
            self.server_host.clone()
        } else {
            self.server_name.clone()
        };
        Ok(Dialer {
            transport: Transport::Tls {
                addr,
                server_name,
                tls,
            },
            mode,
        })
    }
}

/// Failure of `proxy-client request`.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The URL is not http(s)://host:port/path.
    #[error("invalid URL {0:?}")]
    Url(String),
    /// Dialing through the tunnel failed.
    #[error("dialing {address} through proxy-server")]
    Dial {
        /// The destination.
        address: String,
        /// Why.
        #[source]
        source: ClientError,
    },
    /// An https:// URL needs `--request-ca-cert`.
    #[error("an https:// URL needs --request-ca-cert")]
    NoCa,
    /// TLS to the destination.
    #[error("--request-ca-cert")]
    Tls(#[source] tls::TlsError),
    /// TLS handshake with the destination.
    #[error("TLS with {0} failed")]
    Handshake(String, #[source] std::io::Error),
    /// HTTP failure.
    #[error("HTTP exchange with {0} failed")]
    Http(String, #[source] hyper::Error),
    /// Writing the answer out.
    #[error("writing the answer")]
    Output(#[source] std::io::Error),
}

/// Sends one request and writes the status line, headers and body to `out`.
///
/// # Errors
/// See [`RequestError`].
pub async fn request(
    dialer: &Dialer,
    url: &str,
    method: &str,
    ca: &str,
    out: &mut (impl tokio::io::AsyncWrite + Unpin),
) -> Result<StatusCode, RequestError> {
    let target = Target::parse(url)?;
    let address = target.address.clone();
    let io = dialer
        .dial(&address)
        .await
        .map_err(|source| RequestError::Dial {
            address: address.clone(),
            source,
        })?;
    let io = if target.https {
        secure(io, ca, &target).await?
    } else {
        io
    };
    let http_err = |e| RequestError::Http(address.clone(), e);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(http_err)?;
    tokio::spawn(conn);
    let uri = &target.uri;
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let host = uri.authority().map_or(target.host.as_str(), |a| a.as_str());
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, host)
        .header(hyper::header::USER_AGENT, "proxy-client")
        .body(Empty::<Bytes>::new())
        .map_err(|_| RequestError::Url(url.to_owned()))?;
    let response = sender.send_request(request).await.map_err(http_err)?;
    let status = response.status();
    write_response(response, out, &address).await?;
    Ok(status)
}

/// Where a request's URL points.
struct Target {
    /// The URL as given.
    url: String,
    uri: http::Uri,
    https: bool,
    /// The host as the URL writes it (an IPv6 address in brackets).
    host: String,
    /// The host without brackets: the TLS server name.
    bare: String,
    /// `host:port` to dial.
    address: String,
}

impl Target {
    fn parse(url: &str) -> Result<Self, RequestError> {
        let bad = || RequestError::Url(url.to_owned());
        let uri: http::Uri = url.parse().map_err(|_| bad())?;
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(bad()),
        };
        let host = uri.host().ok_or_else(bad)?.to_owned();
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let bare = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let address = if bare.contains(':') {
            format!("[{bare}]:{port}")
        } else {
            format!("{bare}:{port}")
        };
        Ok(Self {
            url: url.to_owned(),
            uri,
            https,
            host,
            bare,
            address,
        })
    }
}

/// TLS over `io` to `target`, trusting the CA bundle at `ca`.
async fn secure(
    io: Box<dyn client::dial::Io>,
    ca: &str,
    target: &Target,
) -> Result<Box<dyn client::dial::Io>, RequestError> {
    if ca.is_empty() {
        return Err(RequestError::NoCa);
    }
    let mut config = (*tls::client_config(std::path::Path::new(ca), None, &[])
        .map_err(RequestError::Tls)?)
    .clone();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let name = rustls_pki_types::ServerName::try_from(target.bare.clone())
        .map_err(|_| RequestError::Url(target.url.clone()))?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, io)
        .await
        .map_err(|e| RequestError::Handshake(target.address.clone(), e))?;
    Ok(Box::new(tls))
}

/// Writes `response`'s status line, headers and body to `out`.
async fn write_response(
    response: hyper::Response<hyper::body::Incoming>,
    out: &mut (impl tokio::io::AsyncWrite + Unpin),
    address: &str,
) -> Result<(), RequestError> {
    let mut head = format!("{:?} {}\n", response.version(), response.status());
    for (name, value) in response.headers() {
        head.push_str(&format!(
            "{name}: {}\n",
            value.to_str().unwrap_or("<binary>")
        ));
    }
    head.push('\n');
    out.write_all(head.as_bytes())
        .await
        .map_err(RequestError::Output)?;
    let mut body = response.into_body();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| RequestError::Http(address.to_owned(), e))?;
        if let Some(data) = frame.data_ref() {
            out.write_all(data).await.map_err(RequestError::Output)?;
        }
    }
    out.flush().await.map_err(RequestError::Output)
}

/// The SOCKS5 reply for a failed dial.
fn socks_reply(error: &ClientError) -> ReplyError {
    let text = error.to_string().to_ascii_lowercase();
    if text.contains("connection refused") {
        ReplyError::ConnectionRefused
    } else if text.contains("timeout") || text.contains("timed out") {
        ReplyError::ConnectionTimeout
    } else if text.contains("no such host") {
        ReplyError::HostUnreachable
    } else if text.contains("no agent available") {
        ReplyError::NetworkUnreachable
    } else {
        ReplyError::GeneralFailure
    }
}

/// Serves SOCKS5 on `listener` until the future is dropped.
pub async fn serve_socks5(
    listener: TcpListener,
    dialer: Dialer,
    credentials: Option<(String, String)>,
) {
    info!(listen = ?listener.local_addr().ok(), auth = credentials.is_some(), "socks5 proxy listening");
    let credentials = Arc::new(credentials);
    loop {
        let (stream, peer) = edge::listen::accept(&listener, "socks5 proxy").await;
        let dialer = dialer.clone();
        let credentials = credentials.clone();
        tokio::spawn(async move {
            if let Err(error) = socks5_connection(stream, &dialer, &credentials).await {
                debug!(peer.addr = %peer, %error, "socks5 connection ended");
            }
        });
    }
}

async fn socks5_connection(
    stream: TcpStream,
    dialer: &Dialer,
    credentials: &Option<(String, String)>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let _ = stream.set_nodelay(true);
    let proto = match credentials {
        Some((user, pass)) => {
            Socks5ServerProtocol::accept_password_auth(stream, |u, p| u == *user && p == *pass)
                .await?
                .0
        }
        None => Socks5ServerProtocol::accept_no_auth(stream).await?,
    };
    let (proto, command, target) = proto.read_command().await?;
    if command != Socks5Command::TCPConnect {
        proto.reply_error(&ReplyError::CommandNotSupported).await?;
        return Ok(());
    }
    // Domain names go to the agent unresolved (socks5h semantics).
    let address = match target {
        TargetAddr::Ip(addr) => addr.to_string(),
        TargetAddr::Domain(host, port) => format!("{host}:{port}"),
    };
    match dialer.dial(&address).await {
        Ok(mut tunnel) => {
            let mut client = proto
                .reply_success(SocketAddr::from(([0, 0, 0, 0], 0)))
                .await?;
            let _ = copy_bidirectional(&mut client, &mut tunnel).await;
            Ok(())
        }
        Err(error) => {
            warn!(%address, error = %DisplayErrorStack(&error), "socks5 dial failed");
            proto.reply_error(&socks_reply(&error)).await?;
            Ok(())
        }
    }
}

type ProxyBody = BoxBody<Bytes, hyper::Error>;

fn text(status: StatusCode, body: String) -> Response<ProxyBody> {
    let mut response = Response::new(Full::new(Bytes::from(body)).map_err(|e| match e {}).boxed());
    *response.status_mut() = status;
    response
}

/// The HTTP status for a failed dial (as proxy-server's HTTP-CONNECT mode maps it).
fn proxy_status(error: &ClientError) -> StatusCode {
    match error {
        ClientError::HttpStatus { status, .. } => {
            StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_GATEWAY)
        }
        ClientError::DialTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        ClientError::Dial { error, .. } => {
            let lower = error.to_ascii_lowercase();
            if lower.contains("timeout") || lower.contains("deadline exceeded") {
                StatusCode::GATEWAY_TIMEOUT
            } else {
                StatusCode::BAD_GATEWAY
            }
        }
        _ => StatusCode::BAD_GATEWAY,
    }
}

async fn http_proxy_request(
    dialer: Dialer,
    mut request: Request<Incoming>,
) -> Result<Response<ProxyBody>, hyper::Error> {
    if request.method() == Method::CONNECT {
        let Some(address) = request.uri().authority().map(|a| a.to_string()) else {
            return Ok(text(
                StatusCode::BAD_REQUEST,
                "CONNECT needs host:port\n".to_owned(),
            ));
        };
        return match dialer.dial(&address).await {
            Ok(mut tunnel) => {
                tokio::spawn(async move {
                    match hyper::upgrade::on(request).await {
                        Ok(upgraded) => {
                            let mut client = TokioIo::new(upgraded);
                            let _ = copy_bidirectional(&mut client, &mut tunnel).await;
                        }
                        Err(error) => debug!(%error, "upgrade failed"),
                    }
                });
                Ok(Response::new(Empty::new().map_err(|e| match e {}).boxed()))
            }
            Err(error) => {
                warn!(%address, error = %DisplayErrorStack(&error), "CONNECT dial failed");
                Ok(text(
                    proxy_status(&error),
                    format!("{}\n", DisplayErrorStack(&error)),
                ))
            }
        };
    }
    // Absolute-form: GET http://host:port/path HTTP/1.1
    let uri = request.uri().clone();
    if uri.scheme_str() != Some("http") {
        return Ok(text(
            StatusCode::BAD_REQUEST,
            "only CONNECT and http:// requests are proxied\n".to_owned(),
        ));
    }
    let Some(host) = uri.host() else {
        return Ok(text(
            StatusCode::BAD_REQUEST,
            "no host in the URL\n".to_owned(),
        ));
    };
    let address = format!("{host}:{}", uri.port_u16().unwrap_or(80));
    let tunnel = match dialer.dial(&address).await {
        Ok(tunnel) => tunnel,
        Err(error) => {
            warn!(%address, error = %DisplayErrorStack(&error), "dial failed");
            return Ok(text(
                proxy_status(&error),
                format!("{}\n", DisplayErrorStack(&error)),
            ));
        }
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tunnel)).await?;
    tokio::spawn(conn);
    *request.uri_mut() = uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .parse()
        .unwrap_or_else(|_| http::Uri::from_static("/"));
    let headers = request.headers_mut();
    headers.remove("proxy-connection");
    headers.remove(hyper::header::PROXY_AUTHORIZATION);
    let response = sender.send_request(request).await?;
    Ok(response.map(BodyExt::boxed))
}

/// Serves an HTTP proxy on `listener` until the future is dropped.
pub async fn serve_http_proxy(listener: TcpListener, dialer: Dialer) {
    info!(listen = ?listener.local_addr().ok(), "http proxy listening");
    loop {
        let (stream, peer) = edge::listen::accept(&listener, "http proxy").await;
        let _ = stream.set_nodelay(true);
        let dialer = dialer.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                http_proxy_request(dialer.clone(), request)
            });
            if let Err(error) = hyper::server::conn::http1::Builder::new()
                .preserve_header_case(true)
                .title_case_headers(true)
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades()
                .await
            {
                debug!(peer.addr = %peer, %error, "http proxy connection ended");
            }
        });
    }
}
