// Prompts cut from held-out text: windows that start at a line start, evenly spaced.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace specdec::text {

// `count` prompts of about `length` bytes from `text`, each starting after a newline, evenly
// spaced through the text. Fewer when the text is too short.
inline std::vector<std::string> line_prompts(const std::vector<uint8_t>& text, size_t count, size_t length) {
  std::vector<std::string> prompts;
  if (text.size() < 2 * length || count == 0) return prompts;
  const size_t stride = (text.size() - 2 * length) / count;
  for (size_t i = 0; i < count; ++i) {
    size_t start = i * stride;
    while (start < text.size() - 2 * length && text[start] != '\n') ++start;
    ++start;
    size_t end = start + length;
    while (end < text.size() && text[end - 1] != '\n') ++end;  // end at a line end
    prompts.emplace_back(text.begin() + static_cast<std::ptrdiff_t>(start), text.begin() + static_cast<std::ptrdiff_t>(end));
  }
  return prompts;
}

}  // namespace specdec::text
