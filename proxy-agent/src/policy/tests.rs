use proptest::prelude::*;

use super::*;

fn policy(text: &str) -> Policy {
    Policy::parse(text, vec!["10.1.2.3".parse().unwrap()]).unwrap()
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

fn denied(rule: &str) -> Decision {
    Decision::Denied(Arc::from(rule))
}

#[test]
fn every_numeric_form_is_the_address_it_names() {
    let loopback = Host::Ip {
        addr: ip("127.0.0.1"),
        zone: None,
    };
    for form in [
        "127.0.0.1",
        "2130706433",
        "0x7f000001",
        "0x7f.1",
        "0177.0.0.1",
        "0177.0.0.01",
        "127.1",
        "127.0.1",
        "0x7F.0.0.0x1",
        "::ffff:127.0.0.1",
        "::ffff:7f00:1",
        "0:0:0:0:0:ffff:127.0.0.1",
    ] {
        assert_eq!(parse_host(form), loopback, "{form}");
    }
    assert_eq!(
        parse_host("fe80::1%eth0"),
        Host::Ip {
            addr: ip("fe80::1"),
            zone: Some("eth0".to_owned())
        }
    );
    assert_eq!(
        parse_host("169.254.43518"),
        Host::Ip {
            addr: ip("169.254.169.254"),
            zone: None
        }
    );
    // Not numbers: names (resolved, then their addresses are checked).
    for name in [
        "0x",
        "08.0.0.1",
        "1.2.3.4.5",
        "256.0.0.1",
        "1.16777216",
        "+1",
        "-1",
        "",
        "a.b",
    ] {
        assert!(matches!(parse_host(name), Host::Name(_)), "{name}");
    }
    assert_eq!(
        parse_host("Metadata.Google.Internal."),
        Host::Name("metadata.google.internal".to_owned())
    );
}

#[test]
fn addresses_split_as_go_splits_them() {
    assert_eq!(split_host_port("10.0.0.1:80"), Some(("10.0.0.1", 80)));
    assert_eq!(split_host_port("[::1]:443"), Some(("::1", 443)));
    assert_eq!(
        split_host_port("[fe80::1%eth0]:1"),
        Some(("fe80::1%eth0", 1))
    );
    assert_eq!(split_host_port("a.example:8080"), Some(("a.example", 8080)));
    for bad in [
        "10.0.0.1", "::1:80", "[::1]", "[::1]80", "a:http", "a:65536",
    ] {
        assert_eq!(split_host_port(bad), None, "{bad}");
    }
}

#[test]
fn the_named_sets_hold_what_they_say() {
    let p = policy("deny loopback\ndeny link-local port 80\ndeny metadata\ndeny node");
    for (addr, rule) in [
        ("127.0.0.1", "deny loopback"),
        ("127.255.0.9", "deny loopback"),
        ("::1", "deny loopback"),
        ("::ffff:127.0.0.2", "deny loopback"),
        ("169.254.1.1", "deny link-local port 80"),
        ("fe80::1", "deny link-local port 80"),
        ("169.254.169.254", "deny link-local port 80"),
        ("10.1.2.3", "deny node"),
    ] {
        assert_eq!(p.check(None, ip(addr), 80), denied(rule), "{addr}");
    }
    // On another port the metadata set, not link-local, refuses.
    for addr in [
        "169.254.169.254",
        "fd00:ec2::254",
        "100.100.100.200",
        "192.0.0.192",
        "169.254.170.2",
        "::ffff:169.254.169.254",
    ] {
        assert_eq!(
            p.check(None, ip(addr), 443),
            denied("deny metadata"),
            "{addr}"
        );
    }
    assert_eq!(
        p.check(None, ip("169.254.1.1"), 443),
        Decision::Allowed(None)
    );
    assert_eq!(p.check(None, ip("10.1.2.4"), 443), Decision::Allowed(None));
}

#[test]
fn deny_wins_over_allow_and_the_default_decides_the_rest() {
    let p = policy(
        "# kubelet on the node network, nothing else\n\
         default deny\n\
         allow 10.0.0.0/8 port 10250\n\
         allow host *.svc.cluster.local\n\
         deny 10.9.0.0/16   # a hostile subnet\n\
         deny host evil.svc.cluster.local\n",
    );
    let allowed = |rule: &str| Decision::Allowed(Some(Arc::from(rule)));
    assert_eq!(
        p.check(None, ip("10.0.0.5"), 10250),
        allowed("allow 10.0.0.0/8 port 10250")
    );
    assert_eq!(p.check(None, ip("10.0.0.5"), 10251), denied("default deny"));
    assert_eq!(
        p.check(None, ip("10.9.0.5"), 10250),
        denied("deny 10.9.0.0/16")
    );
    assert_eq!(
        p.check(Some("a.svc.cluster.local"), ip("192.168.0.1"), 443),
        allowed("allow host *.svc.cluster.local")
    );
    assert_eq!(
        p.check(Some("svc.cluster.local"), ip("192.168.0.1"), 443),
        denied("default deny"),
        "a suffix pattern needs a label before it"
    );
    assert_eq!(
        p.check(Some("evil.svc.cluster.local"), ip("192.168.0.1"), 443),
        denied("deny host evil.svc.cluster.local")
    );
    // An allowed name that resolves into a denied network is denied.
    assert_eq!(
        p.check(Some("a.svc.cluster.local"), ip("10.9.9.9"), 443),
        denied("deny 10.9.0.0/16")
    );
}

#[test]
fn one_denied_address_of_a_name_refuses_the_dial() {
    let p = policy("deny 127.0.0.2");
    let addrs: Vec<SocketAddr> = vec![
        "127.0.0.3:80".parse().unwrap(),
        "127.0.0.2:80".parse().unwrap(),
    ];
    assert_eq!(
        p.check_all(Some("both.example"), &addrs),
        Err((addrs[1], Arc::from("deny 127.0.0.2")))
    );
    assert_eq!(
        p.check_all(Some("one.example"), &addrs[..1]),
        Ok(Decision::Allowed(None))
    );
}

#[test]
fn mapped_networks_in_rules_are_their_ipv4_networks() {
    let p = policy("deny ::ffff:10.0.0.0/104\ndeny ::ffff:127.0.0.2");
    assert!(matches!(
        p.check(None, ip("10.2.3.4"), 1),
        Decision::Denied(_)
    ));
    assert!(matches!(
        p.check(None, ip("127.0.0.2"), 1),
        Decision::Denied(_)
    ));
    assert_eq!(p.check(None, ip("11.0.0.1"), 1), Decision::Allowed(None));
}

#[test]
fn nat64_and_ipv4_compatible_forms_meet_their_ipv4_denies() {
    let p = policy("deny metadata\ndeny loopback\ndeny link-local");
    for (addr, rule) in [
        ("64:ff9b::169.254.169.254", "deny metadata"),
        ("64:ff9b::a9fe:a9fe", "deny metadata"),
        ("64:ff9b::127.0.0.1", "deny loopback"),
        ("64:ff9b::169.254.1.1", "deny link-local"),
        ("::169.254.169.254", "deny metadata"),
        ("::7f00:1", "deny loopback"),
        ("::1", "deny loopback"),
        // Linux connects `::` to the host itself (issue 51).
        ("::", "deny loopback"),
    ] {
        assert_eq!(p.check(None, ip(addr), 80), denied(rule), "{addr}");
    }
    for addr in [
        "64:ff9b::10.0.0.1",
        "64:ff9b:1::127.0.0.1",
        "2001:db8::7f00:1",
    ] {
        assert_eq!(
            p.check(None, ip(addr), 80),
            Decision::Allowed(None),
            "{addr}"
        );
    }
    // Only denies: the default does not judge the IPv4 address, so an
    // allowed NAT64 prefix needs no IPv4 rule per destination.
    let p = policy("allow 64:ff9b::/96\ndeny 10.0.0.0/8 port 22\ndefault deny");
    assert_eq!(
        p.check(None, ip("64:ff9b::203.0.113.9"), 443),
        Decision::Allowed(Some(Arc::from("allow 64:ff9b::/96")))
    );
    assert_eq!(
        p.check(None, ip("64:ff9b::10.1.2.3"), 22),
        denied("deny 10.0.0.0/8 port 22")
    );
    assert_eq!(p.check(None, ip("10.1.2.3"), 443), denied("default deny"));
}

#[test]
fn embedded_ipv4_is_only_nat64_and_compatible() {
    for (addr, v4) in [
        ("64:ff9b::1.2.3.4", Some("1.2.3.4")),
        ("::1.2.3.4", Some("1.2.3.4")),
        ("::1", None),
        ("::", None),
        ("::0.0.255.255", None),
        ("::ffff:1.2.3.4", None),
        ("64:ff9b:1::1.2.3.4", None),
        ("1.2.3.4", None),
    ] {
        assert_eq!(
            embedded_ipv4(ip(addr)),
            v4.map(|v| v.parse().unwrap()),
            "{addr}"
        );
    }
}

#[test]
fn bad_lines_are_named() {
    for (text, line, reason) in [
        ("deny metdata", 1, "is not any, loopback"),
        ("\nallow", 2, "needs a target"),
        ("permit any", 1, "neither allow nor deny"),
        ("deny any port 90-80", 1, "not a port"),
        ("deny any port", 1, "unexpected"),
        ("deny host *", 1, "not a host name"),
        ("deny host a..b", 1, "not a host name"),
        ("default deny\ndefault allow", 2, "a second default"),
        ("deny 10.0.0.0/33", 1, "is not any"),
    ] {
        let error = Policy::parse(text, Vec::new()).unwrap_err();
        assert_eq!(error.line, line, "{text}");
        assert!(error.reason.contains(reason), "{text}: {error}");
    }
    let p = Policy::parse("", Vec::new()).unwrap();
    assert!(p.allows_all());
    assert!(!policy("deny node").allows_all());
    assert!(policy("deny node").uses_node());
}

/// Writes `addr` in one of the forms libc's `inet_aton` accepts.
fn aton_forms(addr: Ipv4Addr) -> Vec<String> {
    let [a, b, c, d] = addr.octets();
    let n = u32::from(addr);
    vec![
        n.to_string(),
        format!("{n:#x}"),
        format!("0{n:o}"),
        format!("{a}.{}", n & 0xff_ffff),
        format!("{a:#x}.0{b:o}.{}", n & 0xffff),
        format!("0{a:o}.0{b:o}.0{c:o}.0{d:o}"),
        format!("{a:#X}.{b}.{c}.{d:#x}"),
        format!("::ffff:{addr}"),
    ]
}

proptest! {
    #[test]
    fn inet_aton_agrees_with_the_address(n: u32) {
        let addr = Ipv4Addr::from(n);
        for form in aton_forms(addr) {
            prop_assert_eq!(
                parse_host(&form),
                Host::Ip { addr: IpAddr::V4(addr), zone: None },
                "{}", form
            );
        }
    }

    /// Whatever form a denied address is written in, the verdict is the
    /// address's.
    #[test]
    fn a_denied_network_is_denied_in_every_form(n: u32, bits in 8u8..=32, port: u16) {
        let addr = Ipv4Addr::from(n);
        let net = ipnet::Ipv4Net::new(addr, bits).unwrap().trunc();
        let p = Policy::parse(&format!("deny {net}"), Vec::new()).unwrap();
        for form in aton_forms(addr) {
            let Host::Ip { addr: parsed, .. } = parse_host(&form) else {
                return Err(TestCaseError::fail(form));
            };
            prop_assert!(matches!(p.check(None, parsed, port), Decision::Denied(_)), "{}", form);
        }
    }

    #[test]
    fn parsing_any_text_never_panics(text in "\\PC{0,200}") {
        let _ = Policy::parse(&text, Vec::new());
        let _ = parse_host(&text);
        let _ = split_host_port(&text);
    }
}

/// Issue 51, item 1: the addresses Linux connects to the host itself are
/// loopback, in every form a frontend can write them.
#[test]
fn the_unspecified_addresses_are_loopback_in_every_form() {
    let p = policy("deny loopback");
    for form in [
        "0.0.0.0",
        "0",
        "0x0",
        "0.0",
        "00.0.0.0",
        "0.1.2.3",
        "::",
        "0:0:0:0:0:0:0:0",
        "::ffff:0.0.0.0",
        "::ffff:0:0",
        "::0.0.0.0",
        "::0.1.2.3",
        "64:ff9b::0.0.0.0",
        "64:ff9b::",
    ] {
        let Host::Ip { addr, .. } = parse_host(form) else {
            panic!("{form} is not numeric");
        };
        assert_eq!(p.check(None, addr, 80), denied("deny loopback"), "{form}");
    }
    for other in ["1.0.0.0", "::2", "100::", "64:ff9b::1.2.3.4"] {
        assert_eq!(
            p.check(None, ip(other), 80),
            Decision::Allowed(None),
            "{other}"
        );
    }
}

/// Every provider's documented metadata address, IPv6 ULA ones too, is in
/// `metadata` (issue 51: GCP's `fd20:ce::254` and EKS Pod Identity's
/// `fd00:ec2::23` passed `deny metadata`), in every form that reaches it.
#[test]
fn every_providers_metadata_address_meets_deny_metadata() {
    let p = policy("deny metadata");
    for addr in [
        "fd20:ce::254",
        "fd00:ec2::23",
        "fd00:ec2::253",
        "fd00:ec2::123",
        "fd00:c1::a9fe:a9fe",
        "fd00:100::100:200",
        "fd00:a9fe:a9fe::1",
        "fd00:42::42",
        "fe80::a9fe:a9fe",
        "169.254.170.23",
        "169.254.169.123",
        "168.63.129.16",
        "169.254.42.42",
        "169.254.0.23",
        "::ffff:168.63.129.16",
        "64:ff9b::169.254.170.23",
    ] {
        assert_eq!(
            p.check(None, ip(addr), 80),
            denied("deny metadata"),
            "{addr}"
        );
    }
    for addr in ["fd20:ce::253", "fd00:ec2::1", "168.63.129.17"] {
        assert_eq!(
            p.check(None, ip(addr), 80),
            Decision::Allowed(None),
            "{addr}"
        );
    }
}
