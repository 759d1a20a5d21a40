//! Reaching proxy-server through a SOCKS5 or HTTP CONNECT proxy, as nodes
//! behind a corporate proxy must: `--proxy-url` (`socks5://`, `socks5h://`,
//! `http://`, optional `user:password@`), else `HTTPS_PROXY`/`https_proxy`
//! or `ALL_PROXY`/`all_proxy`, with `NO_PROXY`/`no_proxy` honoured (host
//! names, `.suffix`es, IPs, CIDRs, `*`) the way curl and kubectl read them.
//! TLS to the server runs inside the proxied connection.

use std::{fmt, net::IpAddr};

use base64::Engine;
use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::io::Io;

/// How the proxy is spoken to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyKind {
    /// SOCKS5; with `remote_dns` (`socks5h`) the proxy resolves names.
    Socks5 {
        /// Send the host name to the proxy instead of resolving it here.
        remote_dns: bool,
    },
    /// HTTP CONNECT.
    Http,
}

/// A proxy to reach proxy-server through.
#[derive(Clone, PartialEq, Eq)]
pub struct Proxy {
    /// Protocol.
    pub kind: ProxyKind,
    /// Proxy host.
    pub host: String,
    /// Proxy port.
    pub port: u16,
    /// `user`, `password` (never printed).
    pub auth: Option<(String, String)>,
}

impl fmt::Display for Proxy {
    /// `scheme://user:***@host:port`: the password is masked.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match self.kind {
            ProxyKind::Socks5 { remote_dns: false } => "socks5",
            ProxyKind::Socks5 { remote_dns: true } => "socks5h",
            ProxyKind::Http => "http",
        };
        write!(f, "{scheme}://")?;
        if let Some((user, _)) = &self.auth {
            write!(f, "{user}:***@")?;
        }
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `--proxy-url` as given on the command line. Its `Debug` (the flags'
/// struct derives it) masks the password as [`Proxy`]'s `Display` does,
/// even when the text does not parse.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ProxyUrl(pub String);

impl From<String> for ProxyUrl {
    fn from(text: String) -> Self {
        Self(text)
    }
}

impl std::ops::Deref for ProxyUrl {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ProxyUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let masked = match self.0.split_once("://") {
            Some((scheme, rest)) => match rest.rsplit_once('@') {
                Some((userinfo, hostport)) => {
                    let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
                    format!("{scheme}://{user}:***@{hostport}")
                }
                None => self.0.clone(),
            },
            None if self.0.contains('@') => "***".to_owned(),
            None => self.0.clone(),
        };
        fmt::Debug::fmt(&masked, f)
    }
}

impl Proxy {
    /// Parses a proxy URL; the error text names what is wrong (never the
    /// password).
    ///
    /// # Errors
    /// Unknown scheme, missing host, bad port.
    pub fn parse(url: &str) -> Result<Self, String> {
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| "want scheme://host:port (socks5, socks5h or http)".to_owned())?;
        let kind = match scheme.to_ascii_lowercase().as_str() {
            "socks5" => ProxyKind::Socks5 { remote_dns: false },
            "socks5h" => ProxyKind::Socks5 { remote_dns: true },
            "http" => ProxyKind::Http,
            other => {
                return Err(format!(
                    "unsupported proxy scheme {other:?} (want socks5, socks5h or http)"
                ));
            }
        };
        let rest = rest.trim_end_matches('/');
        let (auth, hostport) = match rest.rsplit_once('@') {
            Some((userinfo, hostport)) => {
                let (user, pass) = userinfo.split_once(':').unwrap_or((userinfo, ""));
                let decode = |s: &str| {
                    form_urlencoded::parse(format!("x={}", s.replace('+', "%2B")).as_bytes())
                        .next()
                        .map(|(_, v)| v.into_owned())
                        .unwrap_or_default()
                };
                (Some((decode(user), decode(pass))), hostport)
            }
            None => (None, rest),
        };
        let default_port = match kind {
            ProxyKind::Socks5 { .. } => 1080,
            ProxyKind::Http => 80,
        };
        let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
            let (host, after) = v6.split_once(']').ok_or("unclosed [ in the proxy host")?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| format!("bad proxy port {p:?}"))?,
                None => default_port,
            };
            (host.to_owned(), port)
        } else {
            match hostport.rsplit_once(':') {
                Some((h, p)) => (
                    h.to_owned(),
                    p.parse().map_err(|_| format!("bad proxy port {p:?}"))?,
                ),
                None => (hostport.to_owned(), default_port),
            }
        };
        if host.is_empty() {
            return Err("the proxy URL has no host".to_owned());
        }
        Ok(Self {
            kind,
            host,
            port,
            auth,
        })
    }

    /// The proxy the environment asks for to reach `host` (`lookup` reads a
    /// variable): `HTTPS_PROXY`, else `ALL_PROXY` (lower case first, as curl),
    /// unless `NO_PROXY` exempts `host`.
    ///
    /// # Errors
    /// The variable holds a URL that cannot be used (the text names it).
    pub fn from_env(
        lookup: impl Fn(&str) -> Option<String>,
        host: &str,
    ) -> Result<Option<Self>, String> {
        let get = |names: &[&str]| {
            names
                .iter()
                .find_map(|n| lookup(n).filter(|v| !v.is_empty()))
        };
        let Some(url) =
            get(&["https_proxy", "HTTPS_PROXY"]).or_else(|| get(&["all_proxy", "ALL_PROXY"]))
        else {
            return Ok(None);
        };
        if let Some(no_proxy) = get(&["no_proxy", "NO_PROXY"])
            && no_proxy_matches(&no_proxy, host)
        {
            return Ok(None);
        }
        // Like curl, a bare host:port means an HTTP proxy.
        let url = if url.contains("://") {
            url
        } else {
            format!("http://{url}")
        };
        Self::parse(&url)
            .map(Some)
            .map_err(|e| format!("proxy from the environment: {e}"))
    }
}

/// Whether `NO_PROXY` exempts `host`: `*`, an exact name or IP, a domain
/// (with or without a leading dot) and its subdomains, or a CIDR.
pub fn no_proxy_matches(no_proxy: &str, host: &str) -> bool {
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    let ip: Option<IpAddr> = host.parse().ok();
    no_proxy
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .any(|entry| {
            if entry == "*" {
                return true;
            }
            if let (Some(ip), Ok(net)) = (ip, entry.parse::<ipnet::IpNet>()) {
                return net.contains(&ip);
            }
            let entry = entry.to_ascii_lowercase();
            // Drop a port ("host:port"), but not from an IPv6 address.
            let entry = match (entry.parse::<IpAddr>(), entry.rsplit_once(':')) {
                (Err(_), Some((h, p))) if p.chars().all(|c| c.is_ascii_digit()) => h.to_owned(),
                _ => entry,
            };
            let entry = entry.trim_start_matches('[').trim_end_matches(']');
            if let (Some(ip), Ok(e)) = (ip, entry.parse::<IpAddr>()) {
                return ip == e;
            }
            let domain = entry.trim_start_matches('.');
            host == domain || host.ends_with(&format!(".{domain}"))
        })
}

/// Why the proxy did not give us a connection.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The proxy itself could not be reached.
    #[error("cannot reach proxy {proxy}")]
    Unreachable {
        /// The proxy (password masked).
        proxy: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The proxy refused our credentials (SOCKS auth failure, HTTP 407).
    #[error("proxy {proxy} refused the credentials for {target}")]
    AuthRefused {
        /// The proxy (password masked).
        proxy: String,
        /// Where we wanted to go.
        target: String,
    },
    /// The proxy refused or failed to reach the target.
    #[error("proxy {proxy} refused to connect to {target}: {reason}")]
    TargetRefused {
        /// The proxy (password masked).
        proxy: String,
        /// Where we wanted to go.
        target: String,
        /// What it said.
        reason: String,
    },
}

/// Opens a TCP connection to `host:port` through `proxy`.
///
/// # Errors
/// See [`ProxyError`]; every variant names the proxy (masked) and target.
pub async fn connect(proxy: &Proxy, host: &str, port: u16) -> Result<Box<dyn Io>, ProxyError> {
    let tcp = TcpStream::connect((proxy.host.as_str(), proxy.port))
        .await
        .map_err(|source| ProxyError::Unreachable {
            proxy: proxy.to_string(),
            source,
        })?;
    let _ = tcp.set_nodelay(true);
    handshake(tcp, proxy, host, port).await
}

/// The proxy protocol of [`connect`] over `io`, a connection to the proxy
/// already open: asks it for `host:port` and reads its reply (separate so
/// that the replies can be fuzzed over an in-memory pipe).
///
/// # Errors
/// See [`ProxyError`]; every variant names the proxy (masked) and target.
pub async fn handshake<S: Io + 'static>(
    io: S,
    proxy: &Proxy,
    host: &str,
    port: u16,
) -> Result<Box<dyn Io>, ProxyError> {
    let name = proxy.to_string();
    let target = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    match proxy.kind {
        ProxyKind::Socks5 { remote_dns } => {
            use tokio_socks::{Error as SocksError, TargetAddr, tcp::Socks5Stream};
            let addr: TargetAddr<'_> = if remote_dns {
                TargetAddr::Domain(host.into(), port)
            } else {
                let resolved = tokio::net::lookup_host((host, port))
                    .await
                    .ok()
                    .and_then(|mut a| a.next())
                    .ok_or_else(|| ProxyError::TargetRefused {
                        proxy: name.clone(),
                        target: target.clone(),
                        reason: format!(
                            "cannot resolve {host} locally (use socks5h:// to resolve on the proxy)"
                        ),
                    })?;
                TargetAddr::Ip(resolved)
            };
            let result = match &proxy.auth {
                Some((user, pass)) => {
                    Socks5Stream::connect_with_password_and_socket(io, addr, user, pass).await
                }
                None => Socks5Stream::connect_with_socket(io, addr).await,
            };
            match result {
                Ok(stream) => Ok(Box::new(stream)),
                Err(SocksError::PasswordAuthFailure(_) | SocksError::NoAcceptableAuthMethods) => {
                    Err(ProxyError::AuthRefused {
                        proxy: name,
                        target,
                    })
                }
                Err(SocksError::Io(source)) => Err(ProxyError::Unreachable {
                    proxy: name,
                    source,
                }),
                Err(other) => Err(ProxyError::TargetRefused {
                    proxy: name,
                    target,
                    reason: other.to_string(),
                }),
            }
        }
        ProxyKind::Http => http_connect(io, proxy, &name, &target).await,
    }
}

async fn http_connect<S: Io + 'static>(
    io: S,
    proxy: &Proxy,
    name: &str,
    target: &str,
) -> Result<Box<dyn Io>, ProxyError> {
    let failed = |reason: String| ProxyError::TargetRefused {
        proxy: name.to_owned(),
        target: target.to_owned(),
        reason,
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| failed(e.to_string()))?;
    tokio::spawn(conn.with_upgrades());
    let mut request = hyper::Request::connect(target)
        .header(hyper::header::HOST, target)
        .body(Empty::<Bytes>::new())
        .map_err(|e| failed(e.to_string()))?;
    if let Some((user, pass)) = &proxy.auth {
        let credentials =
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"));
        let mut value = hyper::header::HeaderValue::from_str(&format!("Basic {credentials}"))
            .map_err(|_| failed("credentials are not valid header text".to_owned()))?;
        value.set_sensitive(true);
        request
            .headers_mut()
            .insert(hyper::header::PROXY_AUTHORIZATION, value);
    }
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| failed(e.to_string()))?;
    match response.status().as_u16() {
        200..=299 => {
            let upgraded = hyper::upgrade::on(response)
                .await
                .map_err(|e| failed(e.to_string()))?;
            Ok(Box::new(TokioIo::new(upgraded)))
        }
        // 407 is the standard answer; tinyproxy answers 401.
        401 | 407 => Err(ProxyError::AuthRefused {
            proxy: name.to_owned(),
            target: target.to_owned(),
        }),
        _ => Err(failed(format!("HTTP {}", response.status()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_url_flag_debug_masks_the_password() {
        for (text, shown) in [
            ("http://u:s3cret@proxy:3128", "\"http://u:***@proxy:3128\""),
            (
                "socks5://u:s3cret@[::1]:1080/",
                "\"socks5://u:***@[::1]:1080/\"",
            ),
            ("ftp://u:s3cret@a:b@c", "\"ftp://u:***@c\""),
            ("u:s3cret@proxy", "\"***\""),
            ("http://proxy:3128", "\"http://proxy:3128\""),
            ("", "\"\""),
        ] {
            assert_eq!(format!("{:?}", ProxyUrl(text.to_owned())), shown, "{text}");
        }
    }

    #[test]
    fn parses_proxy_urls_and_masks_passwords() {
        let p = Proxy::parse("socks5h://ops:s%40cret@proxy.corp:1081").unwrap();
        assert_eq!(p.kind, ProxyKind::Socks5 { remote_dns: true });
        assert_eq!((p.host.as_str(), p.port), ("proxy.corp", 1081));
        assert_eq!(p.auth, Some(("ops".to_owned(), "s@cret".to_owned())));
        assert_eq!(p.to_string(), "socks5h://ops:***@proxy.corp:1081");
        assert!(!format!("{p:?}").contains("cret"));
        let p = Proxy::parse("http://[::1]:3128/").unwrap();
        assert_eq!(
            (p.kind, p.host.as_str(), p.port),
            (ProxyKind::Http, "::1", 3128)
        );
        assert_eq!(Proxy::parse("socks5://10.0.0.1").unwrap().port, 1080);
        for bad in ["ftp://x:1", "proxy:3128", "http://:80", "http://x:port"] {
            assert!(Proxy::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn no_proxy_matches_like_curl() {
        let list = "localhost, .corp.example, 10.0.0.0/8, 192.168.1.5, ::1, svc.local:443";
        for host in [
            "localhost",
            "a.corp.example",
            "corp.example",
            "10.2.3.4",
            "192.168.1.5",
            "::1",
            "[::1]",
            "svc.local",
        ] {
            assert!(no_proxy_matches(list, host), "{host}");
        }
        for host in [
            "example.com",
            "notcorp.example",
            "11.0.0.1",
            "192.168.1.6",
            "::2",
        ] {
            assert!(!no_proxy_matches(list, host), "{host}");
        }
        assert!(no_proxy_matches("*", "anything"));
    }

    #[test]
    fn the_environment_is_read_as_curl_reads_it() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        let p = Proxy::from_env(
            env(&[("HTTPS_PROXY", "socks5://p:1"), ("ALL_PROXY", "http://q:2")]),
            "server",
        )
        .unwrap()
        .unwrap();
        assert_eq!(p.to_string(), "socks5://p:1");
        let p = Proxy::from_env(
            env(&[("https_proxy", "p:3128"), ("HTTPS_PROXY", "socks5://x:1")]),
            "server",
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            p.to_string(),
            "http://p:3128",
            "lower case first, bare host:port is HTTP"
        );
        let p = Proxy::from_env(env(&[("ALL_PROXY", "socks5h://q:2")]), "server")
            .unwrap()
            .unwrap();
        assert_eq!(p.to_string(), "socks5h://q:2");
        assert_eq!(
            Proxy::from_env(
                env(&[("HTTPS_PROXY", "http://p:1"), ("NO_PROXY", "server")]),
                "server"
            )
            .unwrap(),
            None
        );
        assert_eq!(Proxy::from_env(env(&[]), "server").unwrap(), None);
        assert!(Proxy::from_env(env(&[("HTTPS_PROXY", "ftp://p:1")]), "server").is_err());
    }
}
