//! Proxy strategies (`--proxy-strategies`) and agent identifiers.

use std::net::IpAddr;

use ipnet::IpNet;

/// How a dial picks an agent; tried in the order of `--proxy-strategies`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProxyStrategy {
    /// Any agent, starting at a random one; non-draining preferred.
    Default,
    /// The agent whose `host`/`ipv4`/`ipv6` identifier equals the destination
    /// host; beyond ANP, else the agent with the longest `cidr` identifier
    /// containing a destination IP.
    DestHost,
    /// Any agent that announced `default-route=true`.
    DefaultRoute,
}

impl ProxyStrategy {
    /// The flag spelling (also the `proxy_strategy` metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::DestHost => "destHost",
            Self::DefaultRoute => "defaultRoute",
        }
    }
}

/// Parses `--proxy-strategies`: comma-separated, ordered, no duplicates.
///
/// # Errors
/// An empty list, an unknown name or a repeated one.
pub fn parse_strategies(text: &str) -> Result<Vec<ProxyStrategy>, String> {
    let mut out = Vec::new();
    for name in text.split(',').map(str::trim) {
        let strategy = match name {
            "default" => ProxyStrategy::Default,
            "destHost" => ProxyStrategy::DestHost,
            "defaultRoute" => ProxyStrategy::DefaultRoute,
            "" => return Err("empty proxy strategy".to_owned()),
            other => {
                return Err(format!(
                    "unknown proxy strategy {other:?} (want default, destHost or defaultRoute)"
                ));
            }
        };
        if out.contains(&strategy) {
            return Err(format!("proxy strategy {name:?} given twice"));
        }
        out.push(strategy);
    }
    Ok(out)
}

/// What an agent says about itself in `agentidentifiers`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentIdentifiers {
    /// `host=` values.
    pub hosts: Vec<String>,
    /// `ipv4=` values, kept as given (destHost matches strings exactly, as ANP).
    pub ipv4: Vec<String>,
    /// `ipv6=` values, kept as given.
    pub ipv6: Vec<String>,
    /// `cidr=` values that parse (others are ignored, "fail open" as ANP).
    pub cidrs: Vec<IpNet>,
    /// `default-route=` (first value, Go bool syntax).
    pub default_route: bool,
}

impl AgentIdentifiers {
    /// Parses the URL query string; unknown keys are ignored ("fail open").
    pub fn parse(query: &str) -> Self {
        let mut ids = Self::default();
        let mut saw_default_route = false;
        for (key, value) in form_urlencoded::parse(query.as_bytes()) {
            match key.as_ref() {
                "host" => ids.hosts.push(value.into_owned()),
                "ipv4" => ids.ipv4.push(value.into_owned()),
                "ipv6" => ids.ipv6.push(value.into_owned()),
                "cidr" => ids
                    .cidrs
                    .extend(value.parse::<IpNet>().ok().map(|n| n.trunc())),
                "default-route" if !saw_default_route => {
                    saw_default_route = true;
                    ids.default_route = ops::flags::go_bool(&value).unwrap_or(false);
                }
                _ => {}
            }
        }
        ids
    }

    /// The destHost keys: every host, ipv4 and ipv6 identifier.
    pub fn dest_host_keys(&self) -> impl Iterator<Item = &str> {
        self.hosts
            .iter()
            .chain(&self.ipv4)
            .chain(&self.ipv6)
            .map(String::as_str)
    }
}

impl AgentIdentifiers {
    /// With `--verify-agent-identifiers`: the first identifier that the
    /// agent's certificate, whose names are `names`, does not name, as the
    /// agent wrote it (`host=…`, `ipv4=…`, `ipv6=…`, `cidr=…`); `None` when
    /// it names them all. A `host=` must be one of its DNS names (ASCII
    /// case aside), an `ipv4=`/`ipv6=` one of its IP addresses; a `cidr=` is
    /// never named (no standard name type holds a range);
    /// `default-route=true` needs the URI [`DEFAULT_ROUTE_URI`] (it draws
    /// every dial the `defaultRoute` strategy sends).
    pub fn uncertified(&self, names: &ops::tls::files::AltNames) -> Option<String> {
        if self.default_route && !names.uris.iter().any(|uri| uri == DEFAULT_ROUTE_URI) {
            return Some("default-route=true".to_owned());
        }
        if let Some(host) = self
            .hosts
            .iter()
            .find(|host| !names.dns.iter().any(|dns| dns.eq_ignore_ascii_case(host)))
        {
            return Some(format!("host={host}"));
        }
        let named = |ip: &String| {
            ip.parse::<IpAddr>()
                .is_ok_and(|addr| names.ips.contains(&addr))
        };
        if let Some(ip) = self.ipv4.iter().find(|ip| !named(ip)) {
            return Some(format!("ipv4={ip}"));
        }
        if let Some(ip) = self.ipv6.iter().find(|ip| !named(ip)) {
            return Some(format!("ipv6={ip}"));
        }
        self.cidrs.first().map(|net| format!("cidr={net}"))
    }
}

/// The URI a client certificate names to grant `default-route=true` under
/// `--verify-agent-identifiers` (a subject alternative name of type URI).
pub const DEFAULT_ROUTE_URI: &str = "urn:konnectivity:default-route";

/// With `--verify-agent-identifiers`: whether a certificate whose names are
/// `names` names the agent id `id`: its common name, one of its DNS names
/// (ASCII case aside) or one of its IP addresses (as written).
pub fn names_agent(names: &ops::tls::files::AltNames, id: &str) -> bool {
    names.common_name.as_deref() == Some(id)
        || names.dns.iter().any(|dns| dns.eq_ignore_ascii_case(id))
        || id
            .parse::<IpAddr>()
            .is_ok_and(|addr| names.ips.contains(&addr))
}

/// The host part of a dial address as ANP's `RemovePortFromHost` gives it:
/// `[v6]:port` → `v6`, a bare IPv6 address unchanged, else up to the first `:`.
pub fn host_of(address: &str) -> &str {
    if let Some(rest) = address.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    if address.parse::<IpAddr>().is_ok() {
        return address;
    }
    address.split(':').next().unwrap_or(address)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_strategy_lists() {
        assert_eq!(
            parse_strategies("default"),
            Ok(vec![ProxyStrategy::Default])
        );
        assert_eq!(
            parse_strategies("destHost,defaultRoute"),
            Ok(vec![ProxyStrategy::DestHost, ProxyStrategy::DefaultRoute])
        );
        assert!(parse_strategies("").is_err());
        assert!(parse_strategies("random").unwrap_err().contains("random"));
        assert!(parse_strategies("default,default").is_err());
    }

    #[test]
    fn parses_identifiers() {
        let ids = AgentIdentifiers::parse(
            "host=node-1&host=node%2Da&ipv4=10.0.0.1&ipv6=%3A%3A1&cidr=10.0.0.0%2F8&default-route=true&default-route=false&uid=x&junk",
        );
        assert_eq!(ids.hosts, ["node-1", "node-a"]);
        assert_eq!(ids.ipv4, ["10.0.0.1"]);
        assert_eq!(ids.ipv6, ["::1"]);
        assert_eq!(ids.cidrs, ["10.0.0.0/8".parse::<IpNet>().unwrap()]);
        assert_eq!(
            AgentIdentifiers::parse("cidr=10.1.2.3%2F16&cidr=bogus&cidr=fd00%3A%3A%2F8").cidrs,
            [
                "10.1.0.0/16".parse::<IpNet>().unwrap(),
                "fd00::/8".parse().unwrap()
            ],
            "host bits dropped, junk ignored"
        );
        assert!(ids.default_route);
        assert_eq!(
            ids.dest_host_keys().collect::<Vec<_>>(),
            ["node-1", "node-a", "10.0.0.1", "::1"]
        );
        assert!(!AgentIdentifiers::parse("default-route=maybe").default_route);
    }

    #[test]
    fn only_identifiers_the_certificate_names_are_certified() {
        let names = ops::tls::files::AltNames {
            common_name: None,
            uris: Vec::new(),
            dns: vec!["Node-A".to_owned()],
            ips: vec!["10.0.0.5".parse().unwrap(), "fd00::5".parse().unwrap()],
        };
        let check = |query: &str| AgentIdentifiers::parse(query).uncertified(&names);
        assert_eq!(check(""), None);
        assert_eq!(check("host=node-a&ipv4=10.0.0.5&ipv6=fd00::5"), None);
        assert_eq!(
            check("default-route=true"),
            Some("default-route=true".to_owned()),
            "only a certificate that grants it"
        );
        let granted = ops::tls::files::AltNames {
            uris: vec![DEFAULT_ROUTE_URI.to_owned()],
            ..names.clone()
        };
        assert_eq!(
            AgentIdentifiers::parse("host=node-a&default-route=true").uncertified(&granted),
            None
        );
        assert_eq!(check("default-route=false"), None);
        // The agent id: the common name, a DNS name or an IP address.
        let named = ops::tls::files::AltNames {
            common_name: Some("system:node:node-a".to_owned()),
            ..names.clone()
        };
        for id in [
            "system:node:node-a",
            "node-a",
            "NODE-A",
            "10.0.0.5",
            "fd00::5",
        ] {
            assert!(names_agent(&named, id), "{id}");
        }
        for id in ["node-b", "system:node:node-b", "10.0.0.6", ""] {
            assert!(!names_agent(&named, id), "{id}");
        }
        assert_eq!(check("host=node-b"), Some("host=node-b".to_owned()));
        assert_eq!(check("ipv4=10.0.0.6"), Some("ipv4=10.0.0.6".to_owned()));
        assert_eq!(
            check("ipv4=010.0.0.5"),
            Some("ipv4=010.0.0.5".to_owned()),
            "as written"
        );
        assert_eq!(check("ipv6=fd00::6"), Some("ipv6=fd00::6".to_owned()));
        assert_eq!(
            check("host=node-a&cidr=10.0.0.0/24"),
            Some("cidr=10.0.0.0/24".to_owned())
        );
        assert_eq!(
            AgentIdentifiers::parse("host=node-a").uncertified(&Default::default()),
            Some("host=node-a".to_owned()),
            "a certificate without names names nothing"
        );
    }

    #[test]
    fn strips_ports_like_anp() {
        let cases = [
            ("node-1:10250", "node-1"),
            ("10.0.0.1:22", "10.0.0.1"),
            ("[::1]:443", "::1"),
            ("::1", "::1"),
            ("fe80::1", "fe80::1"),
            ("plainhost", "plainhost"),
        ];
        for (address, host) in cases {
            assert_eq!(host_of(address), host, "{address}");
        }
    }
}
