// Writing JSON text by hand (metrics lines, summary files, the safetensors header): string
// escaping and number formatting that every kiln writer shares, so that files agree byte for
// byte with what serde_json (safetensors) and Python's json module read back.
#pragma once
#include <string>
#include <string_view>

namespace kiln {

// The body of a JSON string literal, without the quotes: `"` and `\` escaped, \b \f \n \r \t
// short, other control characters as \u00XX (lowercase hex, as serde_json writes them).
// Bytes >= 0x80 pass through unchanged: the caller's text is taken to be UTF-8.
std::string json_escape(std::string_view s);

// json_escape with the quotes: "text".
std::string json_string(std::string_view s);

// A number as printf("%.9g") prints it (enough digits to round-trip a float; a double that came
// from a float round-trips too), independent of the C locale. JSON has no NaN or infinity, so
// those become `null`.
std::string json_number(double v);

// The same digits as json_number but NaN/Inf spelled "nan", "inf", "-inf" (for CSV, where
// pandas and numpy read them back).
std::string format_number(double v);

}  // namespace kiln
