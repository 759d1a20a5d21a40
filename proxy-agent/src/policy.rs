//! The destination policy (issue 45): which destinations the agent may
//! connect to. Pure: rules parsed from text, a destination's host
//! normalised, a decision on an address, a port and the name asked. The
//! dial path (`endpoint::dial`) resolves a name once, checks every address
//! here and connects only to checked ones; the file is followed by
//! `destinations`.
//!
//! # Rules
//! One a line, `#` starts a comment:
//!
//! ```text
//! deny metadata                 # a named set
//! deny loopback
//! allow 10.0.0.0/8 port 10250   # a CIDR (or an address), a port
//! deny any port 1-1023          # every address, a port range
//! deny host *.internal          # a name asked (exact, or *.suffix)
//! default deny                  # what no rule matches (default: allow)
//! ```
//!
//! A deny that matches wins over any allow; an address no rule matches
//! gets the default. A dial is refused when any address of its name is
//! denied (a name that answers with a public address and a loopback one is
//! hostile or broken; the order of connects must not decide).

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
};

use ipnet::IpNet;

/// What a rule does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Lets the destination be connected to.
    Allow,
    /// Refuses it.
    Deny,
}

/// A named set of addresses, for what every operator needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NamedSet {
    /// 127.0.0.0/8 and ::1, and the addresses Linux connects to the host
    /// itself: 0.0.0.0/8 ("this network", RFC 1122) and `::` (see
    /// [`reaches_this_host`]).
    Loopback,
    /// 169.254.0.0/16 and fe80::/10.
    LinkLocal,
    /// The cloud metadata services ([`METADATA`]).
    Metadata,
    /// The node's own addresses, as the policy was built with them.
    Node,
}

impl NamedSet {
    fn parse(word: &str) -> Option<Self> {
        Some(match word {
            "loopback" => Self::Loopback,
            "link-local" => Self::LinkLocal,
            "metadata" => Self::Metadata,
            "node" => Self::Node,
            _ => return None,
        })
    }
}

/// The cloud metadata addresses of the major providers: the services on a
/// node's link that hand out instance credentials, identity and
/// configuration, and the provider's link services beside them (DNS, time).
/// Each with the provider's documentation that states it; "not in the
/// provider's documentation" marks an address taken from the provider's
/// own code.
pub const METADATA: [IpAddr; 24] = [
    // AWS, GCP (also its NTP and DNS), Azure, Oracle (also its NTP), IBM
    // Cloud, DigitalOcean, Hetzner, Huawei, Vultr, Exoscale, OpenStack,
    // Linode: the instance metadata service.
    // docs.aws.amazon.com/AWSEC2/latest/UserGuide/instance-identity-documents.html,
    // learn.microsoft.com/azure/virtual-machines/instance-metadata-service,
    // docs.oracle.com/en-us/iaas/Content/Compute/Tasks/gettingmetadata.htm,
    // cloud.ibm.com/apidocs/vpc-metadata,
    // docs.digitalocean.com/products/droplets/how-to/access-metadata/,
    // docs.openstack.org/nova/latest/admin/metadata-service.html.
    v4(169, 254, 169, 254),
    // AWS IMDS over IPv6 (Nitro): same page as above.
    v6([0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254]),
    // AWS Route 53 Resolver: docs.aws.amazon.com/vpc/latest/userguide/AmazonDNS-concepts.html.
    v4(169, 254, 169, 253),
    v6([0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x253]),
    // AWS Time Sync: docs.aws.amazon.com/AWSEC2/latest/UserGuide/configure-ec2-ntp.html.
    v4(169, 254, 169, 123),
    v6([0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x123]),
    // AWS ECS task metadata and credentials:
    // docs.aws.amazon.com/AmazonECS/latest/developerguide/task-metadata-endpoint-v2.html.
    v4(169, 254, 170, 2),
    // AWS EKS Pod Identity Agent (credentials):
    // docs.aws.amazon.com/eks/latest/userguide/pod-id-agent-setup.html.
    v4(169, 254, 170, 23),
    v6([0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x23]),
    // GCP's metadata server over IPv6 (IPv6-only VMs),
    // cloud.google.com/compute/docs/metadata/querying-metadata.
    v6([0xfd20, 0xce, 0, 0, 0, 0, 0, 0x254]),
    // Azure WireServer, the host node's virtual address (VM agent,
    // extension settings, DNS):
    // learn.microsoft.com/azure/virtual-network/what-is-ip-address-168-63-129-16.
    v4(168, 63, 129, 16),
    // Oracle Cloud@Customer and Classic metadata:
    // docs.oracle.com/en/cloud/cloud-at-customer/occ-get-started/retrieve-predefined-instance-metadata.html.
    v4(192, 0, 0, 192),
    // Oracle OCI over IPv6: not in the provider's documentation; Oracle's
    // OKE node bootstrap script asks http://[fd00:c1::a9fe:a9fe]/opc/v2.
    v6([0xfd00, 0xc1, 0, 0, 0, 0, 0xa9fe, 0xa9fe]),
    // Alibaba ECS metadata: alibabacloud.com/help/en/ecs/user-guide/view-instance-metadata.
    v4(100, 100, 100, 200),
    // Alibaba over IPv6: not in the documentation we could read; named by
    // Alibaba's own change to cloud-init (PR 6893).
    v6([0xfd00, 0x100, 0, 0, 0, 0, 0x100, 0x200]),
    // Linode/Akamai metadata over IPv6:
    // linode.com/docs/products/compute/compute-instances/guides/metadata-api/.
    v6([0xfd00, 0xa9fe, 0xa9fe, 0, 0, 0, 0, 1]),
    // OpenStack Nova over IPv6 (link-local, also in `link-local`):
    // docs.openstack.org/nova/latest/admin/metadata-service.html.
    v6([0xfe80, 0, 0, 0, 0, 0, 0xa9fe, 0xa9fe]),
    // Scaleway instance metadata, IPv4 and IPv6:
    // scaleway.com/en/developers/api/instance/user-data.
    v4(169, 254, 42, 42),
    v6([0xfd00, 0x42, 0, 0, 0, 0, 0, 0x42]),
    // Tencent CVM metadata (metadata.tencentyun.com): the address is not in
    // the provider's documentation (its name is: intl.cloud.tencent.com/document/product/213/4934).
    v4(169, 254, 0, 23),
    // Alibaba private DNS: alibabacloud.com/help/en/ecs/user-guide/ecs-private-domain-resolution.
    v4(100, 100, 2, 136),
    v4(100, 100, 2, 138),
    // IBM Cloud DNS Services resolvers:
    // cloud.ibm.com/docs/dns-svcs?topic=dns-svcs-managing-permitted-networks.
    v4(161, 26, 0, 7),
    v4(161, 26, 0, 8),
];

const fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

const fn v6(s: [u16; 8]) -> IpAddr {
    IpAddr::V6(Ipv6Addr::new(
        s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7],
    ))
}

/// What a rule matches besides the port.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// Every destination.
    Any,
    /// A named set.
    Set(NamedSet),
    /// A network (an address is a /32 or /128).
    Net(IpNet),
    /// The name asked, lower case without a final dot.
    Host(HostPattern),
}

/// A host-name pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostPattern {
    /// This name only.
    Exact(String),
    /// Names ending in this (it starts with a dot): `*.example.com`
    /// matches `a.example.com`, not `example.com`.
    Suffix(String),
}

/// One rule.
#[derive(Debug, Clone)]
struct Rule {
    action: Action,
    target: Target,
    /// The ports it applies to, inclusive; every port if `None`.
    ports: Option<(u16, u16)>,
    /// The rule as written (words joined by one space): how refusals,
    /// logs and the metric name it.
    text: Arc<str>,
}

/// A parsed policy, with the node's addresses it was built with.
#[derive(Debug, Clone)]
pub struct Policy {
    rules: Vec<Rule>,
    default: Action,
    node: Vec<IpAddr>,
}

/// What the policy said of a destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// It may be connected to; the allow rule that matched, if one did
    /// (else the default allowed it).
    Allowed(Option<Arc<str>>),
    /// Refused, by this rule (`default deny` when none matched).
    Denied(Arc<str>),
}

impl std::fmt::Display for Decision {
    /// As a span's attribute and a log show it: `allowed`, `allowed (rule
    /// R)`, `denied (rule R)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Allowed(None) => f.write_str("allowed"),
            Self::Allowed(Some(rule)) => write!(f, "allowed (rule {rule})"),
            Self::Denied(rule) => write!(f, "denied (rule {rule})"),
        }
    }
}

/// A policy file that cannot be used: the line and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct PolicyError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong with it.
    pub reason: String,
}

impl Policy {
    /// The policy of an agent given none: everything allowed (ANP's
    /// behaviour).
    pub fn allow_all() -> Self {
        Self {
            rules: Vec::new(),
            default: Action::Allow,
            node: Vec::new(),
        }
    }

    /// Parses `text` (see the module documentation); `node` is what the
    /// `node` set holds.
    ///
    /// # Errors
    /// The first line that is not a rule, named.
    pub fn parse(text: &str, node: Vec<IpAddr>) -> Result<Self, PolicyError> {
        let mut rules = Vec::new();
        let mut default = None;
        for (index, line) in text.lines().enumerate() {
            let error = |reason: String| PolicyError {
                line: index + 1,
                reason,
            };
            let words: Vec<&str> = line
                .split('#')
                .next()
                .unwrap_or_default()
                .split_whitespace()
                .collect();
            match words.as_slice() {
                [] => {}
                ["default", action] => {
                    if default.is_some() {
                        return Err(error("a second default".to_owned()));
                    }
                    default = Some(parse_action(action).map_err(error)?);
                }
                _ => rules.push(parse_rule(&words).map_err(error)?),
            }
        }
        Ok(Self {
            rules,
            default: default.unwrap_or(Action::Allow),
            node,
        })
    }

    /// Whether the `node` set is used (its addresses are worth re-reading).
    pub fn uses_node(&self) -> bool {
        self.rules
            .iter()
            .any(|r| r.target == Target::Set(NamedSet::Node))
    }

    /// Whether this policy allows everything without looking (no rules,
    /// default allow): the dial path can skip the checks.
    pub fn allows_all(&self) -> bool {
        self.rules.is_empty() && self.default == Action::Allow
    }

    /// The verdict on connecting to `addr` (normalised: see
    /// [`canonical`]) at `port`, for a dial that asked for `name` (`None`
    /// when the destination was numeric).
    ///
    /// An IPv6 address that carries an IPv4 one ([`embedded_ipv4`]: NAT64's
    /// well-known prefix, IPv4-compatible) is also denied by the deny rules
    /// that match its IPv4 address (not by the default: a network that
    /// allows its NAT64 prefix needs no IPv4 rule for each destination).
    pub fn check(&self, name: Option<&str>, addr: IpAddr, port: u16) -> Decision {
        let addr = addr.to_canonical();
        let verdict = self.check_one(name, addr, port);
        let Some(v4) = embedded_ipv4(addr).filter(|_| matches!(verdict, Decision::Allowed(_)))
        else {
            return verdict;
        };
        self.rules
            .iter()
            .filter(|rule| rule.action == Action::Deny)
            .find(|rule| self.matches(rule, name, IpAddr::V4(v4), port))
            .map_or(verdict, |rule| Decision::Denied(rule.text.clone()))
    }

    /// [`Policy::check`] of `addr` as it is.
    fn check_one(&self, name: Option<&str>, addr: IpAddr, port: u16) -> Decision {
        let mut allowed = None;
        for rule in &self.rules {
            if !self.matches(rule, name, addr, port) {
                continue;
            }
            match rule.action {
                Action::Deny => return Decision::Denied(rule.text.clone()),
                Action::Allow => {
                    allowed.get_or_insert_with(|| rule.text.clone());
                }
            }
        }
        match (allowed, self.default) {
            (Some(rule), _) => Decision::Allowed(Some(rule)),
            (None, Action::Allow) => Decision::Allowed(None),
            (None, Action::Deny) => Decision::Denied(Arc::from("default deny")),
        }
    }

    /// The verdict on a dial to every address of `addrs`: the first
    /// denied one and its rule, or the verdict on the first (what an
    /// audit record shows). Empty `addrs` are allowed (nothing to connect).
    ///
    /// # Errors
    /// An address is denied: it, and the rule.
    pub fn check_all(
        &self,
        name: Option<&str>,
        addrs: &[SocketAddr],
    ) -> Result<Decision, (SocketAddr, Arc<str>)> {
        let mut first = None;
        for addr in addrs {
            match self.check(name, addr.ip(), addr.port()) {
                Decision::Denied(rule) => return Err((*addr, rule)),
                allowed => {
                    first.get_or_insert(allowed);
                }
            }
        }
        Ok(first.unwrap_or(Decision::Allowed(None)))
    }

    fn matches(&self, rule: &Rule, name: Option<&str>, addr: IpAddr, port: u16) -> bool {
        if rule
            .ports
            .is_some_and(|(low, high)| port < low || port > high)
        {
            return false;
        }
        match &rule.target {
            Target::Any => true,
            Target::Net(net) => net.contains(&addr),
            Target::Host(pattern) => name.is_some_and(|name| pattern.matches(name)),
            Target::Set(set) => self.in_set(*set, addr),
        }
    }

    fn in_set(&self, set: NamedSet, addr: IpAddr) -> bool {
        match (set, addr) {
            (NamedSet::Loopback, addr) => addr.is_loopback() || reaches_this_host(addr),
            (NamedSet::LinkLocal, IpAddr::V4(v4)) => v4.is_link_local(),
            (NamedSet::LinkLocal, IpAddr::V6(v6)) => v6.is_unicast_link_local(),
            (NamedSet::Metadata, addr) => METADATA.contains(&addr),
            (NamedSet::Node, addr) => self.node.contains(&addr),
        }
    }
}

impl HostPattern {
    fn matches(&self, name: &str) -> bool {
        match self {
            Self::Exact(exact) => name == exact,
            Self::Suffix(suffix) => name.len() > suffix.len() && name.ends_with(suffix.as_str()),
        }
    }
}

fn parse_action(word: &str) -> Result<Action, String> {
    match word {
        "allow" => Ok(Action::Allow),
        "deny" => Ok(Action::Deny),
        other => Err(format!("{other:?} is neither allow nor deny")),
    }
}

/// `<allow|deny> <target> [port <p>|<low>-<high>]`, where the target is
/// `any`, a named set, an address or CIDR, or `host <name>|*.<suffix>`.
fn parse_rule(words: &[&str]) -> Result<Rule, String> {
    let (action, rest) = words.split_first().ok_or("an empty rule")?;
    let action = parse_action(action)?;
    let (target, rest) = match rest {
        ["host", pattern, rest @ ..] => (Target::Host(parse_host_pattern(pattern)?), rest),
        ["any", rest @ ..] => (Target::Any, rest),
        [word, rest @ ..] => (parse_address_target(word)?, rest),
        [] => return Err("a rule needs a target".to_owned()),
    };
    let ports = match rest {
        [] => None,
        ["port", ports] => Some(parse_ports(ports)?),
        other => return Err(format!("unexpected {:?} after the target", other.join(" "))),
    };
    Ok(Rule {
        action,
        target,
        ports,
        text: Arc::from(words.join(" ")),
    })
}

fn parse_address_target(word: &str) -> Result<Target, String> {
    if let Some(set) = NamedSet::parse(word) {
        return Ok(Target::Set(set));
    }
    if let Ok(net) = word.parse::<IpNet>() {
        return Ok(Target::Net(canonical_net(net)));
    }
    if let Ok(addr) = word.parse::<IpAddr>() {
        return Ok(Target::Net(IpNet::from(addr.to_canonical())));
    }
    Err(format!(
        "{word:?} is not any, loopback, link-local, metadata, node, an address or a CIDR \
         (a name is written host {word})"
    ))
}

/// An IPv4-mapped IPv6 network (`::ffff:10.0.0.0/104`) as the IPv4 network
/// it is, since addresses are checked in their IPv4 form.
fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.addr().to_ipv4_mapped() {
            Some(v4) => ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96)
                .map_or(net, IpNet::V4)
                .trunc(),
            None => net.trunc(),
        },
        _ => net.trunc(),
    }
}

fn parse_host_pattern(pattern: &str) -> Result<HostPattern, String> {
    let name = normalise_name(pattern);
    let (suffix, label_check) = match name.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, name.as_str()),
    };
    let valid = !label_check.is_empty()
        && label_check
            .split('.')
            .all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
    if !valid {
        return Err(format!("{pattern:?} is not a host name or *.suffix"));
    }
    Ok(if suffix {
        HostPattern::Suffix(name[1..].to_owned())
    } else {
        HostPattern::Exact(name)
    })
}

fn parse_ports(text: &str) -> Result<(u16, u16), String> {
    let bad = || format!("{text:?} is not a port or a range low-high");
    let (low, high) = text.split_once('-').unwrap_or((text, text));
    let low: u16 = low.parse().map_err(|_| bad())?;
    let high: u16 = high.parse().map_err(|_| bad())?;
    if low > high {
        return Err(bad());
    }
    Ok((low, high))
}

/// A host name as rules compare it: lower case, without a final dot.
pub fn normalise_name(name: &str) -> String {
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

/// The host of a destination, normalised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    /// A numeric address in any form libc or Go accept, as the address
    /// it is (IPv4-mapped IPv6 as IPv4), with its IPv6 zone if it had one.
    Ip {
        /// The address.
        addr: IpAddr,
        /// The zone (`eth0`, `2`), for link-local IPv6.
        zone: Option<String>,
    },
    /// A name to resolve, as rules compare it ([`normalise_name`]).
    Name(String),
}

/// Normalises the host of a destination (brackets already stripped):
/// IPv6 with or without a zone (`fe80::1%eth0`), IPv4-mapped IPv6 as IPv4,
/// and every IPv4 form `inet_aton` accepts (`2130706433`, `0x7f.1`,
/// `0177.0.0.1`, `127.1`); anything else is a name.
pub fn parse_host(host: &str) -> Host {
    let (bare, zone) = match host.split_once('%') {
        Some((bare, zone)) => (bare, Some(zone)),
        None => (host, None),
    };
    if let Ok(v6) = bare.parse::<Ipv6Addr>() {
        return Host::Ip {
            addr: canonical(IpAddr::V6(v6)),
            zone: zone.filter(|z| !z.is_empty()).map(str::to_owned),
        };
    }
    if zone.is_none()
        && let Some(v4) = inet_aton(host)
    {
        return Host::Ip {
            addr: IpAddr::V4(v4),
            zone: None,
        };
    }
    Host::Name(normalise_name(host))
}

/// NAT64's well-known prefix (RFC 6052), `64:ff9b::/96`: its first six
/// segments.
const NAT64_PREFIX: [u16; 6] = [0x64, 0xff9b, 0, 0, 0, 0];

/// The IPv4 address an IPv6 one carries in its last 32 bits, for the forms
/// that reach it: NAT64's well-known prefix (`64:ff9b::a.b.c.d` reaches
/// `a.b.c.d` through a translator), and the deprecated IPv4-compatible
/// `::a.b.c.d` (RFC 4291; not `::`, `::1` nor any `::0.0.x.y`).
/// IPv4-mapped addresses are not here: [`canonical`] turns them into IPv4
/// before any rule sees them.
pub fn embedded_ipv4(addr: IpAddr) -> Option<Ipv4Addr> {
    let IpAddr::V6(v6) = addr else {
        return None;
    };
    let segments = v6.segments();
    let (prefix, last) = segments.split_at(6);
    let v4 = Ipv4Addr::from((u32::from(last[0]) << 16) | u32::from(last[1]));
    let compatible = prefix == [0; 6] && last[0] != 0;
    (prefix == NAT64_PREFIX || compatible).then_some(v4)
}

/// Whether `addr` is one of the unspecified forms that Linux connects to
/// the host itself: a `connect` to 0.0.0.0 reaches 127.0.0.1 and one to
/// `::` reaches ::1. The rest of 0.0.0.0/8 is "this network" (RFC 1122),
/// never a destination elsewhere. Their IPv4-mapped forms are IPv4 by the
/// time a rule sees them ([`canonical`]); NAT64 and IPv4-compatible ones
/// carry their IPv4 address ([`embedded_ipv4`]), and `::0.0.0.0` is `::`.
pub fn reaches_this_host(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(v4) => v4.octets()[0] == 0,
        IpAddr::V6(v6) => v6.is_unspecified(),
    }
}

/// An address as rules see it: IPv4-mapped IPv6 as IPv4.
pub fn canonical(addr: IpAddr) -> IpAddr {
    addr.to_canonical()
}

/// libc's `inet_aton`: one to four parts, each decimal, octal (leading
/// `0`) or hex (`0x`); the last part fills the remaining bytes.
pub fn inet_aton(text: &str) -> Option<Ipv4Addr> {
    let parts: Vec<&str> = text.split('.').collect();
    if parts.len() > 4 {
        return None;
    }
    let values = parts
        .iter()
        .map(|p| aton_part(p))
        .collect::<Option<Vec<u32>>>()?;
    let (last, leading) = values.split_last()?;
    if leading.iter().any(|v| *v > 0xff) {
        return None;
    }
    let rest_bits = 8 * (4 - leading.len() as u32);
    if rest_bits < 32 && *last >> rest_bits != 0 {
        return None;
    }
    let high = leading
        .iter()
        .enumerate()
        .fold(0u32, |acc, (i, v)| acc | v << (24 - 8 * i as u32));
    Some(Ipv4Addr::from(high | last))
}

fn aton_part(part: &str) -> Option<u32> {
    let (digits, radix) =
        if let Some(hex) = part.strip_prefix("0x").or_else(|| part.strip_prefix("0X")) {
            (hex, 16)
        } else if part.len() > 1 && part.starts_with('0') {
            (&part[1..], 8)
        } else {
            (part, 10)
        };
    // `from_str_radix` takes a sign; inet_aton does not.
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    u32::from_str_radix(digits, radix).ok()
}

/// Splits `host:port` or `[ipv6]:port` as Go's `net.SplitHostPort` does;
/// `None` when there is no port or it is not a number.
pub fn split_host_port(address: &str) -> Option<(&str, u16)> {
    let (host, port) = if let Some(rest) = address.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        (host, after.strip_prefix(':')?)
    } else {
        let (host, port) = address.rsplit_once(':')?;
        if host.contains(':') {
            return None;
        }
        (host, port)
    };
    Some((host, port.parse().ok()?))
}

#[cfg(test)]
mod tests;
