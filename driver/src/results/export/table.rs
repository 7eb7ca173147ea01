//! The table for a terminal (comfy-table), and the same as Markdown.

use comfy_table::{presets, CellAlignment, ContentArrangement, Table};

use super::{cells, headers, Export, Groups};

/// `--format table` or `--format markdown`.
pub struct TableExport {
    /// Markdown pipes instead of box drawing.
    pub markdown: bool,
}

/// The columns aligned right, numbers all: from the first to the last of these, which the time
/// to a target falls between.
const NUMBERS: (&str, &str) = ("microbatches", "comm");

impl Export for TableExport {
    fn render(&self, rows: &Groups) -> String {
        let mut out = String::new();
        let headers = headers(rows.extra);
        let with_note = rows.groups.iter().flat_map(|(_, r)| r).any(|r| r.note.is_some());
        let width = if with_note {
            headers.len()
        } else {
            headers.len() - 1
        };
        let column = |name: &str| {
            headers
                .iter()
                .position(|h| h == name)
                .expect("a column of HEADERS")
        };
        let numbers = column(NUMBERS.0)..=column(NUMBERS.1);
        for (i, (value, members)) in rows.groups.iter().enumerate() {
            if let Some(key) = rows.key {
                if i > 0 {
                    out.push('\n');
                }
                out.push_str(&format!("{key} = {value}\n"));
                if self.markdown {
                    out.push('\n');
                }
            }
            let mut table = Table::new();
            table
                .load_style(if self.markdown {
                    presets::ASCII_MARKDOWN
                } else {
                    presets::UTF8_FULL_CONDENSED
                })
                .set_content_arrangement(ContentArrangement::Disabled)
                .set_header(&headers[..width]);
            for row in members {
                let mut c = cells(row, rows.extra);
                c.truncate(width);
                table.add_row(c);
            }
            for i in numbers.clone() {
                if let Some(column) = table.column_mut(i) {
                    column.set_cell_alignment(CellAlignment::Right);
                }
            }
            out.push_str(&table.to_string());
            out.push('\n');
        }
        if rows.groups.iter().all(|(_, r)| r.is_empty()) {
            out.push_str("(no records match)\n");
        }
        out
    }
}
