//! Aligned text tables for people.

/// Renders rows under a header with columns padded to the widest cell.
pub fn render(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let n = cells.len();
        for (i, c) in cells.into_iter().enumerate() {
            out.push_str(c);
            if i + 1 < n {
                let pad = widths[i].saturating_sub(c.chars().count()) + 2;
                out.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push('\n');
    };
    line(header.to_vec(), &mut out);
    for r in rows {
        line(r.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn aligns() {
        let t = super::render(
            &["ID", "STATE"],
            &[
                vec!["a".into(), "running".into()],
                vec!["long-id".into(), "x".into()],
            ],
        );
        assert_eq!(t, "ID       STATE\na        running\nlong-id  x\n");
    }
}
