//! The table for a terminal (comfy-table), and the same as Markdown.

use comfy_table::{presets, CellAlignment, ContentArrangement, Table};

use super::{cells, Export, Groups, HEADERS};

/// `--format table` or `--format markdown`.
pub struct TableExport {
    /// Markdown pipes instead of box drawing.
    pub markdown: bool,
}

/// Columns aligned right (numbers).
const RIGHT: [usize; 10] = [4, 5, 6, 7, 8, 9, 10, 11, 12, 13];

impl Export for TableExport {
    fn render(&self, rows: &Groups) -> String {
        let mut out = String::new();
        let with_note = rows.groups.iter().flat_map(|(_, r)| r).any(|r| r.note.is_some());
        let width = if with_note {
            HEADERS.len()
        } else {
            HEADERS.len() - 1
        };
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
                .set_header(&HEADERS[..width]);
            for row in members {
                let mut c = cells(row);
                c.truncate(width);
                table.add_row(c);
            }
            for i in RIGHT {
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
