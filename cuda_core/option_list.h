// Options given as comma-separated names ("ffn,norms"), split in one place.
#pragma once

#include <string>
#include <vector>

namespace nanoq {

// The non-empty names of a comma-separated list.
inline std::vector<std::string> split_option_list(const std::string& names) {
    std::vector<std::string> out;
    std::size_t begin = 0;
    while (begin <= names.size()) {
        std::size_t end = names.find(',', begin);
        if (end == std::string::npos) end = names.size();
        if (end > begin) out.push_back(names.substr(begin, end - begin));
        begin = end + 1;
    }
    return out;
}

}  // namespace nanoq
