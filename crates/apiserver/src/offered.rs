//! Creates no node of the cluster could ever take, whatever its load: a substrate no node
//! offers, or a node selector (`node.<key>=<value>` labels) no node matches. They are the
//! caller's mistake (400 saying what the nodes do offer), not a lack of room (503).

use dsec_wire::api::{CreateSandboxRequest, Substrate};

use crate::watcher::NodeView;

/// `container`, `microvm`, ... as on the wire.
fn name(s: Substrate) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// The refusal for `req` when no known node offers its substrate or matches its selector;
/// None while some node might (or some node has not reported its status yet).
pub fn never_placeable(nodes: &[NodeView], req: &CreateSandboxRequest) -> Option<String> {
    if nodes.is_empty() {
        return None;
    }
    let mut statuses = Vec::with_capacity(nodes.len());
    for n in nodes {
        statuses.push(n.status.as_ref()?);
    }
    if statuses.iter().all(|s| !s.substrates.is_empty())
        && !statuses
            .iter()
            .any(|s| s.substrates.contains(&req.substrate))
    {
        let mut offered: Vec<String> = statuses
            .iter()
            .flat_map(|s| s.substrates.iter().map(|x| name(*x)))
            .collect();
        offered.sort();
        offered.dedup();
        return Some(format!(
            "substrate {:?} is not offered by any node of this cluster; use one of: {}",
            name(req.substrate),
            offered.join(", ")
        ));
    }
    let selector: Vec<(&str, &str)> = req
        .labels
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("node.").map(|k| (k, v.as_str())))
        .collect();
    if !selector.is_empty()
        && !statuses.iter().any(|s| {
            selector
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
    {
        let wanted: Vec<String> = selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
        return Some(format!(
            "no node has the labels {} that the request's node.* labels select; see the nodes' labels in GET /v1/nodes",
            wanted.join(", ")
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EdgeEndpoint;
    use dsec_wire::api::NodeStatus;

    fn node(substrates: Vec<Substrate>, zone: &str) -> NodeView {
        NodeView {
            index: 0,
            endpoint: EdgeEndpoint {
                node_id: None,
                url: "http://n.dsec.test".into(),
                token: String::new(),
            },
            node_id: Some("n".into()),
            status: Some(NodeStatus {
                substrates,
                labels: [("zone".to_string(), zone.to_string())].into(),
                ..Default::default()
            }),
            healthy: false,
            last_seen: None,
            last_error: None,
            polled: true,
            cordoned: true,
        }
    }

    #[test]
    fn names_what_the_nodes_offer() {
        let nodes = vec![
            node(vec![Substrate::Container], "a"),
            node(vec![Substrate::Container, Substrate::Microvm], "b"),
        ];
        let req = |s: Substrate, sel: Option<&str>| {
            let mut r = CreateSandboxRequest {
                substrate: s,
                ..Default::default()
            };
            if let Some(z) = sel {
                r.labels.insert("node.zone".into(), z.into());
            }
            r
        };
        // Offered somewhere (even by an unhealthy, cordoned node): not a mistake.
        assert_eq!(
            never_placeable(&nodes, &req(Substrate::Microvm, None)),
            None
        );
        assert_eq!(
            never_placeable(&nodes, &req(Substrate::Container, Some("b"))),
            None
        );
        let m = never_placeable(&nodes, &req(Substrate::Function, None)).unwrap();
        assert!(
            m.contains("\"function\"") && m.contains("container, microvm"),
            "{m}"
        );
        let m = never_placeable(&nodes, &req(Substrate::Container, Some("c"))).unwrap();
        assert!(m.contains("zone=c"), "{m}");
        // A node without a status yet might offer it.
        let mut unknown = nodes.clone();
        unknown.push(NodeView {
            status: None,
            ..node(vec![], "a")
        });
        assert_eq!(
            never_placeable(&unknown, &req(Substrate::Function, None)),
            None
        );
        assert_eq!(never_placeable(&[], &req(Substrate::Function, None)), None);
    }
}
