//! Small value grammars of the topology file: sizes (`"512MiB"`), devices (`"cuda:3"`),
//! listen addresses (`"10.0.0.1:7000"`, `"[::1]:7000"`), host addresses and names.
//! Each parser returns the reason for a refusal as a lowercase phrase for messages.

use std::net::IpAddr;

use crate::topology::{Device, NetAddr};

const KIB: u64 = 1 << 10;

/// Binary units, largest first. Decimal units (`GB`) are refused: users mean both.
const UNITS: &[(&str, u64)] = &[
    ("tib", KIB * KIB * KIB * KIB),
    ("gib", KIB * KIB * KIB),
    ("mib", KIB * KIB),
    ("kib", KIB),
    ("b", 1),
    ("", 1),
];

/// Parses a size: a number (integer or decimal) followed by an optional binary unit `B`,
/// `KiB`, `MiB`, `GiB` or `TiB` (any case, spaces allowed). Decimal results round down to
/// whole bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number = number.replace('_', "");
    let unit = unit.trim();
    if number.is_empty() {
        return Err("it does not start with a number".into());
    }
    let lower = unit.to_ascii_lowercase();
    let Some(&(_, scale)) = UNITS.iter().find(|(name, _)| *name == lower) else {
        return Err(unit_reason(unit));
    };
    if let Ok(whole) = number.parse::<u64>() {
        return whole
            .checked_mul(scale)
            .ok_or_else(|| "it does not fit in 64 bits".to_string());
    }
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{number}` is not a number"))?;
    let bytes = value * scale as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err("it does not fit in 64 bits".into());
    }
    Ok(bytes as u64)
}

fn unit_reason(unit: &str) -> String {
    let lower = unit.to_ascii_lowercase();
    let binary = match lower.as_str() {
        "k" | "kb" => Some("KiB"),
        "m" | "mb" => Some("MiB"),
        "g" | "gb" => Some("GiB"),
        "t" | "tb" => Some("TiB"),
        _ => None,
    };
    match binary {
        Some(b) => format!("`{unit}` is ambiguous; write {b} (powers of 1024)"),
        None => format!("`{unit}` is not a unit (B, KiB, MiB, GiB, TiB)"),
    }
}

/// Formats a byte count with the largest binary unit that keeps the value at least 1:
/// `2 GiB`, `1.5 MiB`, `100 B`.
pub fn format_size(bytes: u64) -> String {
    const NAMES: &[(&str, u64)] = &[
        ("TiB", KIB * KIB * KIB * KIB),
        ("GiB", KIB * KIB * KIB),
        ("MiB", KIB * KIB),
        ("KiB", KIB),
    ];
    for &(name, scale) in NAMES {
        if bytes >= scale {
            if bytes.is_multiple_of(scale) {
                return format!("{} {name}", bytes / scale);
            }
            let value = format!("{:.2}", bytes as f64 / scale as f64);
            let value = value.trim_end_matches('0').trim_end_matches('.');
            return format!("{value} {name}");
        }
    }
    format!("{bytes} B")
}

/// `"cpu"` or `"cuda:N"`.
pub(crate) fn parse_device(text: &str) -> Result<Device, String> {
    if text == "cpu" {
        return Ok(Device::Cpu);
    }
    if text == "cuda" {
        return Err("cuda needs a GPU index, e.g. \"cuda:0\"".into());
    }
    match text.strip_prefix("cuda:") {
        Some(index) if !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()) => index
            .parse::<u32>()
            .map(Device::Cuda)
            .map_err(|_| format!("GPU index {index} is too large")),
        Some(index) => Err(format!("`{index}` is not a GPU index")),
        None => Err("devices are \"cpu\" and \"cuda:N\"".into()),
    }
}

/// `host:port`, with IPv6 hosts in brackets. The port must be 1..=65535 (0 asks the
/// system for any port, which other processes could not know).
pub(crate) fn parse_net_addr(text: &str) -> Result<NetAddr, String> {
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (ip, after) = rest
            .split_once(']')
            .ok_or_else(|| "`[` without a closing `]`".to_string())?;
        let port = after
            .strip_prefix(':')
            .ok_or_else(|| "it has no :port".to_string())?;
        if ip.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("`{ip}` is not an IPv6 address"));
        }
        (ip, port)
    } else {
        let (host, port) = text
            .rsplit_once(':')
            .ok_or_else(|| "it has no :port".to_string())?;
        if host.contains(':') {
            return Err("write IPv6 addresses in brackets, e.g. [::1]:8000".into());
        }
        check_host_address(host)?;
        (host, port)
    };
    let port = match port.parse::<u16>() {
        Ok(0) => return Err("port 0 is not a fixed port".into()),
        Ok(port) => port,
        Err(_) => return Err(format!("port `{port}` is not a number in 1..=65535")),
    };
    Ok(NetAddr {
        host: host.to_owned(),
        port,
    })
}

/// An IP address or a DNS name, without a port.
pub(crate) fn check_host_address(text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Err("it is empty".into());
    }
    if text.parse::<IpAddr>().is_ok() {
        return Ok(());
    }
    if text.contains(':') {
        return Err("it has a port or is an IPv6 address with a port".into());
    }
    let name = text.strip_suffix('.').unwrap_or(text);
    let valid_label = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if name.len() > 253 || !name.split('.').all(valid_label) {
        return Err("it is neither an IP address nor a DNS name".into());
    }
    Ok(())
}

/// Names of hosts, models and groups: not empty, at most 128 characters, no whitespace,
/// quotes or control characters (they appear in logs, metric labels and API requests).
pub(crate) fn check_name(text: &str) -> Result<(), &'static str> {
    if text.is_empty() {
        return Err("it is empty");
    }
    if text.chars().count() > 128 {
        return Err("it is longer than 128 characters");
    }
    if text
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || c == '"' || c == '\'')
    {
        return Err("it contains whitespace, a quote or a control character");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_accept_binary_units_and_refuse_decimal_ones() {
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2 GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1.5gib"), Ok(3 << 29));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("10B"), Ok(10));
        assert_eq!(parse_size("1_024 KiB"), Ok(1 << 20));
        assert_eq!(parse_size("1TiB"), Ok(1 << 40));
        let gb = parse_size("2GB").expect_err("decimal unit");
        assert!(gb.contains("write GiB"), "{gb}");
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("1.2.3GiB").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("99999999999999999999TiB").is_err());
        assert!(parse_size("17000000TiB").is_err());
    }

    #[test]
    fn sizes_format_with_the_largest_unit() {
        assert_eq!(format_size(2 << 30), "2 GiB");
        assert_eq!(format_size(3 << 29), "1.5 GiB");
        assert_eq!(format_size(512 << 20), "512 MiB");
        assert_eq!(format_size(1000), "1000 B");
        assert_eq!(format_size(1025), "1 KiB");
    }

    #[test]
    fn devices() {
        assert_eq!(parse_device("cpu"), Ok(Device::Cpu));
        assert_eq!(parse_device("cuda:7"), Ok(Device::Cuda(7)));
        for bad in [
            "cuda",
            "cuda:",
            "cuda:x",
            "gpu:0",
            "CPU",
            "cuda:-1",
            "cuda:99999999999",
        ] {
            assert!(parse_device(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn net_addrs() {
        let a = parse_net_addr("10.0.0.1:7000").expect("ipv4");
        assert_eq!((a.host.as_str(), a.port), ("10.0.0.1", 7000));
        let b = parse_net_addr("[::1]:8000").expect("ipv6");
        assert_eq!((b.host.as_str(), b.port), ("::1", 8000));
        let c = parse_net_addr("node-a.example:1").expect("name");
        assert_eq!(c.host, "node-a.example");
        for bad in [
            "10.0.0.1",
            "10.0.0.1:0",
            "10.0.0.1:70000",
            "::1:8000",
            "[::1]8000",
            "[zz]:1",
            ":80",
            "bad host:80",
        ] {
            assert!(parse_net_addr(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn host_addresses_and_names() {
        for good in [
            "10.0.0.1",
            "::1",
            "node-a",
            "node-a.example.org",
            "localhost",
        ] {
            assert_eq!(check_host_address(good), Ok(()), "{good}");
        }
        for bad in ["", "10.0.0.1:80", "-a", "a..b", "a_b", "with space"] {
            assert!(check_host_address(bad).is_err(), "{bad}");
        }
        assert_eq!(check_name("meta-llama/Llama-3-70B"), Ok(()));
        for bad in ["", "a b", "a\"b", "tab\t"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_name(&"x".repeat(129)).is_err());
    }
}
