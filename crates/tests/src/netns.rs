//! Network namespaces for fault tests: one namespace per host, each joined to a bridge
//! in the root namespace by a veth pair, so that the test (in the root namespace, on the
//! bridge's address) reaches every host, and a host's link can be cut and healed.
//! Removed on drop. Needs root (CI runs as root).

use std::process::Command;

/// Namespaces `<tag>-<host>` on the bridge `<tag>br`, at `10.213.<n>.<i>` (the bridge
/// is `.254`).
#[derive(Debug)]
pub struct Net {
    tag: String,
    subnet: String,
    hosts: Vec<String>,
}

/// `ip ARGS`, failing with its error output.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running `ip`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Net {
    /// One namespace per host name; `salt` keeps the names of two tests apart.
    pub fn create(hosts: &[&str], salt: u32) -> Result<Net, String> {
        let id = (std::process::id() + salt) % 200 + 20;
        let mut net = Net {
            tag: format!("ts{id}"),
            subnet: format!("10.213.{id}"),
            hosts: Vec::new(),
        };
        let br = format!("{}br", net.tag);
        ip(&["link", "add", &br, "type", "bridge"])?;
        ip(&["link", "set", &br, "up"])?;
        ip(&["addr", "add", &format!("{}.254/24", net.subnet), "dev", &br])?;
        for name in hosts {
            net.hosts.push((*name).to_string());
            let ns = net.ns(name);
            let inside = format!("{}{name}0", net.tag);
            let outside = net.link(name);
            ip(&["netns", "add", &ns])?;
            ip(&[
                "link", "add", &inside, "type", "veth", "peer", "name", &outside,
            ])?;
            ip(&["link", "set", &inside, "netns", &ns])?;
            ip(&["link", "set", &outside, "master", &br])?;
            ip(&["link", "set", &outside, "up"])?;
            let addr = format!("{}/24", net.addr(name));
            ip(&["-n", &ns, "addr", "add", &addr, "dev", &inside])?;
            ip(&["-n", &ns, "link", "set", &inside, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// `create`, or `None` with a SKIPPED line where namespaces cannot be made — a failure
    /// when `CI` is set.
    pub fn create_or_skip(hosts: &[&str], salt: u32) -> Option<Net> {
        match Net::create(hosts, salt) {
            Ok(net) => Some(net),
            Err(why) => {
                let message = format!("cannot create network namespaces (needs root): {why}");
                if std::env::var_os("CI").is_some() {
                    panic!("{message}");
                }
                eprintln!("SKIPPED: {message}");
                None
            }
        }
    }

    pub fn ns(&self, host: &str) -> String {
        format!("{}-{host}", self.tag)
    }

    /// The host's address.
    pub fn addr(&self, host: &str) -> String {
        let i = self
            .hosts
            .iter()
            .position(|h| h == host)
            .expect("a host of this net");
        format!("{}.{}", self.subnet, i + 1)
    }

    /// The root namespace's address on the bridge.
    pub fn bridge_addr(&self) -> String {
        format!("{}.254", self.subnet)
    }

    /// The host's veth end on the bridge.
    fn link(&self, host: &str) -> String {
        format!("{}{host}1", self.tag)
    }

    /// Cuts the host off from every other (its link to the bridge goes down).
    pub fn cut(&self, host: &str) -> Result<(), String> {
        ip(&["link", "set", &self.link(host), "down"])
    }

    /// Joins it again.
    pub fn heal(&self, host: &str) -> Result<(), String> {
        ip(&["link", "set", &self.link(host), "up"])
    }
}

/// A [`crate::Cluster::wrap`] that runs each named process (`name`, namespace) in its
/// namespace with `ip netns exec`, and any other in the root namespace.
pub fn wrap(namespaces: Vec<(String, String)>) -> crate::Wrap {
    Box::new(move |name| {
        namespaces
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, ns)| vec!["ip".into(), "netns".into(), "exec".into(), ns.clone()])
            .unwrap_or_default()
    })
}

impl Drop for Net {
    fn drop(&mut self) {
        for name in &self.hosts {
            let _ = ip(&["netns", "del", &self.ns(name)]);
        }
        let _ = ip(&["link", "del", &format!("{}br", self.tag)]);
    }
}
